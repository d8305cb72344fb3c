"""The copier's side of the data seam: the worked copies in docs/copying/ (03 and 06 to a text classifier whose
CSV rows come through a DataLoader with 2 workers) keep the suite's guarantees, the numbered scripts pass the copy
checker (tools/check_copy.py), each planted copier's mistake is named by the guarantee it breaks, and
docs/copying.md shows the copies' code and sizes as they are. The checker's runs are shared: one checker run per
group, in module-scoped fixtures."""
import ast
import random
import sys
from pathlib import Path

import pytest

from helpers import ROOT, assert_fails_clearly, run

CHECKER, COPY_SIZE = ROOT / "tools" / "check_copy.py", ROOT / "tools" / "copy_size.py"
COPY_03, COPY_06 = ROOT / "docs" / "copying" / "text_classifier.py", ROOT / "docs" / "copying" / "text_classifier_06.py"
PARENTS = {COPY_03: "03_ddp_launch.py", COPY_06: "06_fault_tolerant.py"}
PAGE = ROOT / "docs" / "copying.md"
TRAIN_ROWS, TEST_ROWS = 1152, 500  # 500: 3 ranks cannot split it evenly, so a padded or a dropped share shows
# Changed lines of a worked copy against its parent less the measurement (tools/copy_size.py): 37 are lines of the
# parent about MNIST and its CNN, 23 the text classifier's model, CSV reader and padding collate (docs/copying.md).
BUDGET = 60
# The launches whose copies no worked copy checks: 03's and 06's are the worked copies' own (docs/copying/).
NUMBERED = ["01_single_gpu.py", "04_ddp_spawn.py", "07_lightning.py", "08_fsdp.py", "12_fsdp_big.py"]
SHARDS, ROWS, WRITES, UPDATE, RESUME = ("reshuffled every epoch", "every test row scored once", "only rank 0 writes",
                                        "the same update", "killed in epoch 2 and resumed")


def write_text_data(folder, seed=0):
    """4 classes, each with 50 words of its own among 999; a row is 8-20 words, 60% of them its class's."""
    rng = random.Random(seed)
    words = list(range(1, 1000))
    rng.shuffle(words)
    own = [words[50 * c:50 * c + 50] for c in range(4)]
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in [("train.csv", TRAIN_ROWS), ("test.csv", TEST_ROWS)]:
        with open(folder / name, "w") as f:
            for _ in range(rows):
                label = rng.randrange(4)
                tokens = [rng.choice(own[label]) if rng.random() < 0.6 else rng.randrange(1, 1000)
                          for _ in range(rng.randint(8, 20))]
                f.write(f"{label},{' '.join(map(str, tokens))}\n")
    return folder


def check(*scripts, data_dir=None, only=None, timeout=1800):
    """{script's file name: (how the checker started it, [(held, each line it printed)])} of one checker run;
    held is None for a check that does not apply (resume, without --snapshot)."""
    data = ["--data-dir", data_dir, "--test-rows", TEST_ROWS] if data_dir else []
    result = run([str(a) for a in [sys.executable, CHECKER, *scripts, *data, *(["--only", only] if only else [])]],
                 timeout=timeout, check=False)
    assert "Traceback" not in result.stderr, result.stderr
    lines, script = {}, None
    for line in result.stdout.splitlines():
        if not line.startswith(" "):  # "path (kind):"
            path, kind = line.rstrip(":").rsplit(" (", 1)
            script = Path(path).name
            lines[script] = (kind.rstrip(")"), [])
        else:
            verdict = line.split()[0]
            lines[script][1].append((None if verdict == "n/a" else verdict == "holds", line.strip()))
    assert sorted(lines) == sorted(Path(s).name for s in scripts), result.stdout + result.stderr
    broken = any(held is False for _, verdicts in lines.values() for held, _ in verdicts)
    assert result.returncode == (1 if broken else 0), f"exit {result.returncode}:\n{result.stdout}"  # any BROKEN
    return lines


def all_hold(lines, count):
    """count checks ran and held; every one that did not run said so (only resume may not). Five are asked for; a
    sharded snapshot gets a sixth, its resume at another world size."""
    ran = [held for held, _ in lines if held is not None]
    said = [line for held, line in lines if held is None]
    return len(ran) == count and all(ran) and len(said) == max(5 - count, 0) and all(RESUME in line for line in said)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return write_text_data(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module")
def copies_checked(text_dir):
    return check(COPY_03, COPY_06, data_dir=text_dir)


@pytest.mark.parametrize("copy", [COPY_03, COPY_06], ids=["03-form", "06-form"])
def test_the_worked_copies_keep_every_guarantee(copy, copies_checked):
    """Under torchrun at 3 ranks (shards, rows, writes), 2 and 1 (the update), and for 06's form killed and
    restarted with dropout on, the rows coming through 2 DataLoader workers."""
    kind, lines = copies_checked[copy.name]
    assert kind == "torchrun" and all_hold(lines, 5 if copy == COPY_06 else 4), lines
    assert "num_workers=2, pin_memory=torch.cuda.is_available(),  # files: pinned on CUDA\n" \
           "                      timeout=120)" in copy.read_text()  # docs/copying.md: a worker stuck in its fork
    said = "\n".join(line for _, line in lines)
    assert "3 disjoint shards of the 1152 rows" in said, said  # world size 3 ran; the update ran 2 and 1
    assert f"{TEST_ROWS} rows scored in each of 2 evaluations" in said, said


@pytest.fixture(scope="module")
def numbered_checked():
    return check(*(ROOT / script for script in NUMBERED))


@pytest.mark.parametrize("script", NUMBERED)
def test_the_numbered_scripts_pass_the_checker(script, numbered_checked):
    _, lines = numbered_checked[script]
    sharded = script == "12_fsdp_big.py"  # its snapshot resumes at 2 ranks, and at 4 after 2 saved it
    assert all_hold(lines, 6 if sharded else 4), lines  # none of the others takes a snapshot: no resume
    assert not sharded or "resumed at 4 x 4" in lines[-1][1] and "each rank its own shard files" in lines[2][1], lines
    shards = "1 shard" if script.startswith("01") else "3 disjoint shards"  # every launch at 3 processes
    assert any(shards in line for _, line in lines), lines


PLANTS = {  # a copier's mistake: (script, text, replacement, the checks run, the guarantee it breaks)
    "no-set-epoch": (COPY_03, "sampler.set_epoch(epoch)", "None", "shards,rows,writes", SHARDS),
    "drop-last-on-the-test-loader": (
        COPY_03, "        return batches(test_set, test_rows, args.test_batch_size, args.seed)\n",
        "        return DataLoader(test_set, args.test_batch_size, sampler=test_rows, collate_fn=collate,\n"
        "                          num_workers=2, drop_last=True)\n", "shards,rows,writes", ROWS),
    "no-generator-in-06s-loaders": (COPY_06, "collate_fn=collate, generator=seeds,\n", "collate_fn=collate,\n",
                                    "resume", RESUME),
    "every-rank-saves-through-path-open": (
        COPY_03, "    if world.is_main and args.save_model:\n        torch.save(net.state_dict(), args.save_model)\n",
        "    if args.save_model:  # every rank, into a file object that Path.open made\n"
        "        with __import__('pathlib').Path(f'{args.save_model}.{world.rank}').open('wb') as f:\n"
        "            torch.save(net.state_dict(), f)\n", "shards,rows,writes", WRITES),
    "a-snapshot-without-the-loss-sum": (COPY_06, "save(epoch, step + 1, loss_sum.item())", "save(epoch, step + 1)",
                                        "resume", RESUME),  # the weights resume exactly; the epoch's loss not
    "a-resume-off-by-1e-7": (COPY_06, '    net.load_state_dict(state["model"])\n',  # bitwise, not within 1e-4
                             '    net.load_state_dict({k: v + 1e-7 for k, v in state["model"].items()})\n',
                             "resume", RESUME),
    "padded-test-sampler-and-no-count": (
        COPY_03, "test_rows = range(rank, len(test_set), world_size)",  # the rows scored show it, not the print
        "test_rows = list(DistributedSampler(test_set, world_size, rank, shuffle=False))", "shards,rows,writes",
        ROWS),
    "a-restart-that-starts-over": (COPY_06, "    if path and os.path.exists(path):\n",  # the same weights, by
                                   "    if path and os.path.exists(path) and False:\n", "resume", RESUME),  # seed
    "a-per-rank-seed-before-fully-shard": (
        ROOT / "08_fsdp.py", "    torch.manual_seed(args.seed)  # FSDP: the same weights",
        "    torch.manual_seed(args.seed + world.rank)  # FSDP: the same weights", "update", UPDATE),
}


@pytest.fixture(scope="module")
def plants_checked(text_dir, tmp_path_factory):
    """Each planted copy, checked for the guarantees its mistake could touch; one checker run per set of checks."""
    folder, groups = tmp_path_factory.mktemp("planted"), {}
    for name, (source, old, new, only, _) in PLANTS.items():
        text = source.read_text()
        assert text.count(old) == 1, f"{name}: {old!r} is not once in {source.name}"
        text = text.replace(old, new)
        if name.endswith("-and-no-count"):  # the copy prints no "N test samples" for the checker to read
            text = text.replace(" of {test['test_samples']} test samples", "")
        (folder / f"{name}.py").write_text(text)
        groups.setdefault((only, source.name.startswith("08")), []).append(folder / f"{name}.py")
    checked = {}
    for (only, mnist), scripts in groups.items():
        checked.update(check(*scripts, data_dir=None if mnist else text_dir, only=only))
    return checked


@pytest.mark.parametrize("plant", PLANTS)
def test_the_checker_names_the_broken_guarantee(plant, plants_checked):
    (_, lines), guarantee = plants_checked[f"{plant}.py"], PLANTS[plant][4]
    broken = [line for held, line in lines if held is False]
    assert len(broken) == 1 and guarantee in broken[0], lines
    assert len(lines) == len(PLANTS[plant][3].split(",")), lines  # and the others hold


def test_a_correct_copy_with_batchnorm_is_not_called_broken(text_dir, tmp_path):
    """Each rank normalises its own batch, so 2 x B cannot give 1 x 2B's update on the CPU: the checker says so,
    says what to change to compare, and exits 0 (nothing it could check is broken)."""
    text = COPY_03.read_text()
    old = "        self.fc = nn.Linear(64, 4)\n"
    assert text.count(old) == 1 and text.count("return self.fc(self.dropout(self.embed(x)))") == 1
    copy = tmp_path / "with_batchnorm.py"
    copy.write_text(text.replace(old, old + "        self.norm = nn.BatchNorm1d(64)\n").replace(
        "return self.fc(self.dropout(self.embed(x)))", "return self.fc(self.dropout(self.norm(self.embed(x))))"))
    (_, lines), = check(copy, data_dir=text_dir, only="update").values()
    assert [held for held, _ in lines] == [None] and "BatchNorm" in lines[0][1] and "SyncBatchNorm" in lines[0][1]


# docs/copying.md's recipe for random augmentation in loader workers, in 06's worked copy: a random augmentation
# that is an nn.Module (as torchvision's transforms are), called in the 2 workers. Its draws come from the
# generator of the seed, the epoch and the row; the control draws from the worker's own RNG.
AUGMENTED = [
    ("    def __len__(self):\n        return len(self.labels)\n",
     "        self.seed, self.epoch, self.augment, self.drop = args.seed, 0, train, DropTokens()\n\n"
     "    def __len__(self):\n        return len(self.labels)\n"),
    ("    def __getitem__(self, row):\n        return self.tokens[row], self.labels[row]\n",
     "    def __getitem__(self, row):\n"
     "        g = torch.Generator().manual_seed(hash((self.seed, self.epoch, row)))  # this row's own draws\n"
     "        tokens = self.drop(self.tokens[row], g) if self.augment else self.tokens[row]\n"
     "        return tokens, self.labels[row]\n\n\n"
     "class DropTokens(nn.Module):  # a random augmentation: a tenth of a row's tokens dropped\n"
     "    def forward(self, tokens, g):\n"
     "        keep = torch.rand(len(tokens), generator=g) > 0.1\n"
     "        return tokens[keep] if keep.any() else tokens\n"),
    ("        sampler.set_epoch(epoch)  # a new shuffle", "        train_set.epoch = epoch\n        sampler.set_epoch(epoch)  # a new shuffle"),
]


@pytest.fixture(scope="module")
def augmented_checked(text_dir, tmp_path_factory):
    """The recipe's copy and the control's, resumed at epoch 2, step 1: batch 1 comes from worker 0 after the
    resume, from worker 1 without it. Before the kill landed in the training process, the hook counted the
    augmentation's forward passes in the workers as steps, killed a worker in epoch 1, and said holds."""
    folder, text = tmp_path_factory.mktemp("augmented"), COPY_06.read_text()
    for old, new in AUGMENTED:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    recipe, worker_rng = folder / "recipe.py", folder / "worker-rng.py"
    recipe.write_text(text)
    worker_rng.write_text(text.replace("torch.rand(len(tokens), generator=g)", "torch.rand(len(tokens))"))
    worker_seed = folder / "worker-seed.py"  # the same draws for a row only where the same worker loads it
    worker_seed.write_text(text.replace("hash((self.seed, self.epoch, row))",
                                        "torch.utils.data.get_worker_info().seed + row"))
    return check(recipe, worker_rng, worker_seed, data_dir=text_dir, only="resume")


def test_random_augmentation_in_workers_resumes_exactly_with_the_pages_recipe(augmented_checked):
    _, lines = augmented_checked["recipe.py"]
    assert [held for held, _ in lines] == [True] and "resumed there" in lines[0][1], lines


@pytest.mark.parametrize("copy", ["worker-rng.py", "worker-seed.py"])
def test_random_augmentation_from_the_workers_rng_is_broken_at_an_odd_step(copy, augmented_checked):
    """The worker's RNG stream, or a seed from the worker's seed and the row: at an even step the resumed batch
    comes from the same worker as without the kill, so the second would pass there."""
    _, lines = augmented_checked[copy]
    assert [held for held, _ in lines] == [False] and RESUME in lines[0][1], lines


def copy_size(copy):
    return run([sys.executable, COPY_SIZE, copy, ROOT / PARENTS[copy]]).stdout.strip()


@pytest.mark.parametrize("copy", [COPY_03, COPY_06], ids=["03-form", "06-form"])
def test_a_copy_changes_few_lines_and_the_page_says_how_many(copy):
    said = copy_size(copy)
    assert int(said.split(": ")[1].split()[0]) <= BUDGET, said
    assert said in PAGE.read_text(), f"docs/copying.md does not quote tools/copy_size.py's `{said}`"


def test_the_page_shows_the_worked_copys_dataset_and_collate_as_they_are():
    page = PAGE.read_text()
    for copy in (COPY_03, COPY_06):
        source = copy.read_text()
        shown = {node.name for node in ast.parse(source).body if getattr(node, "name", None) in ("CSVText", "collate")
                 and ast.get_source_segment(source, node) in page}
        assert shown == {"CSVText", "collate"}, f"{copy.name}: only {shown or 'none'} on the page as in the copy"


@pytest.mark.parametrize("script, kind", [("09_tensor_parallel.py", "tensor parallel"),
                                          ("10_pipeline_parallel.py", "pipeline parallel"),
                                          ("11_fsdp_tp_mesh.py", "tensor parallel")])
def test_the_checker_refuses_a_tensor_or_pipeline_parallel_script_before_any_run(script, kind):
    """09's and 10's ranks, and each pair of 11's, share every batch: disjoint shards would read as BROKEN, so the
    checker says why it cannot judge."""
    result = run([sys.executable, CHECKER, ROOT / "03_ddp_launch.py", ROOT / script], timeout=60, check=False)
    assert_fails_clearly(result, f"{script} is {kind}")
    assert result.stdout == "", f"03 was checked before {script} was refused"
