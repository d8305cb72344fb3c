"""What the README teaches is kept true: it reads top to bottom within 320 lines (each word defined before its use,
its sections in a learner's order, maintainer material in docs/maintainers.md), its excerpts and the diffs in
docs/diffs/ are current, every link, path and test name the docs cite exists, the scripts share their common parts
word for word, and what it says of PyTorch itself (the legacy launcher, the backends' messages, Lightning 2, the
sampler's padding) holds for the installed version. (The SLURM batch script is run by a real scheduler:
test_slurm.py; the README's DDP claims and common errors: test_readme_claims.py.)"""
import argparse
import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from helpers import MODES, ROOT, SCRIPTS, TEST_IMAGES, definitions, free_port, load_script, run
from bench.family import COMMON_FLAGS

# Definitions that every numbered script carries word for word.
SHARED = ["Net", "in_range", "writable", "MNIST", "collate", "batches", "clock"]
# The data seam, load_data: one text for the scripts whose ranks each take a share (01 and 02 as the one rank of 1),
# another for those that also take as many test batches on every rank (08 and 11, and 09, whose every rank takes all).
SEAMS = [["01", "02", "03", "04", "05", "07", "10"], ["08", "09", "11"]]
NUMBERED = sorted(path.name for path in ROOT.glob("[0-9][0-9]_*.py"))
TOOL = ROOT / "tools" / "script_diffs.py"
# The Markdown a reader is sent to; docs/diffs/ is generated and checked by the tool.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "results" / "README.md",
         ROOT / "tests" / "README.md"]
TOP_LEVEL = {"bench", "tests", "slurm", "docs", "results", "tools", ".ci"}
README = ROOT / "README.md"
MAINTAINERS = ROOT / "docs" / "maintainers.md"
README_LINES = 320  # DESIGN.md's
MEASUREMENT_LINES = 62  # 60 until the record named its script, mode and data itself (issue 60)
# A learner's order: the words, why DDP, the scripts, the reader's machine, the errors, the posts, the benchmark,
# then the way on. Each a prefix of a heading.
SECTIONS = ["Words you will meet", "Why DDP", "Set-up", "The scripts", "Running on the machine you have",
            "Common errors", "Coming from the blog posts", "Benchmark your machine", "Several machines", "Copying",
            "The way on"]
# Words a learner meets, each defined in docs/glossary.md, one term a row. The README's "Words you will meet" is
# that table's first rows, and defines each of its words before the README uses it anywhere else.
WORDS = ["rank", "world size", "local rank", "node rank", "collective", "broadcast", "all-reduce", "barrier",
         "backend", "process group", "store", "rendezvous", "launcher", "bucket", "global batch", "replica",
         "scatter", "gather", "replicate", "step", "epoch", "shard", "stage", "microbatch", "bubble", "mesh"]
GLOSSARY = ROOT / "docs" / "glossary.md"


def metrics_writes(script):
    """The code of each block that writes --metrics-json (test_reliability.py interrupts 01's)."""
    tree = ast.parse((ROOT / script).read_text())
    return [ast.unparse(node) for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test) == "path"]


def test_the_family_table_names_every_numbered_script():
    assert NUMBERED == SCRIPTS, "a numbered script without its row in bench/family.py, or a row without its script"


def test_the_readme_tree_and_markers_name_every_row_of_the_family_table():
    readme = README.read_text()
    tree = re.search(r"## The scripts.*?```text\n(.*?)```", readme, re.S).group(1)
    for mode in MODES.values():
        assert re.search(rf"\b{mode.number} ", tree), f"the README's tree has no {mode.number}"
        if mode.parent:
            assert f"`# {mode.marker}`" in readme, f"the README names no marker `# {mode.marker}`"


def test_the_scripts_share_model_data_pipeline_and_checks_word_for_word():
    reference, write = definitions(SCRIPTS[0]), metrics_writes(SCRIPTS[0])
    assert len(write) == 1
    for script in SCRIPTS[1:]:
        mine = definitions(script)
        for name in SHARED:
            assert mine.get(name) == reference[name], f"{script}: {name} differs from {SCRIPTS[0]}'s"
        assert metrics_writes(script) == write, f"{script} writes --metrics-json otherwise than {SCRIPTS[0]}"
    for numbers in SEAMS:
        seams = {script: definitions(script)["load_data"] for script in SCRIPTS if script[:2] in numbers}
        assert len(seams) == len(numbers) and len(set(seams.values())) == 1, f"load_data differs among {numbers}"


def measurement_block(script):
    """The lines from `# ---- Measurement` down to, not including, `if __name__`: what a copier may delete."""
    lines = (ROOT / script).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# ---- Measurement"))
    end = next(i for i, line in enumerate(lines) if line.startswith("if __name__"))
    return lines[start:end]


def test_the_measurement_block_is_the_same_in_every_script_and_short():
    """What the benchmark needs is one block, word for word in every script, of 60 lines at most: what a script
    alone knows goes in through its world (02's devices, 07's nodes, 09's data_ranks), not through a copy."""
    block = measurement_block(SCRIPTS[0])
    assert len(block) <= MEASUREMENT_LINES, f"{SCRIPTS[0]}'s measurement block has {len(block)} lines"
    for script in SCRIPTS[1:]:
        assert measurement_block(script) == block, f"{script}'s measurement block differs from {SCRIPTS[0]}'s"


def test_each_script_is_the_one_before_plus_a_small_diff_in_short_lines():
    """The budgets and line limits of bench/family.py (DESIGN.md's): raising one is an edit of that table."""
    tool = load_script("tools/script_diffs.py")  # its diff counts as diff -U0
    for mode in MODES.values():
        if mode.budget is not None:
            changed = tool.changed_lines(tool.unified(ROOT, mode.parent, mode.script, 0))
            assert changed <= mode.budget, f"{mode.parent} -> {mode.script}: {changed} changed lines, " \
                                           f"the budget is {mode.budget}"
        lines = (ROOT / mode.script).read_text().splitlines()
        assert len(lines) <= mode.max_lines, f"{mode.script}: {len(lines)} lines, the limit is {mode.max_lines}"
        assert max(map(len, lines)) <= 100, f"{mode.script}: a line of {max(map(len, lines))} characters"


def test_each_script_has_the_common_flags_and_its_own_and_no_others():
    """The table's flags column against each script's add_argument calls (each flag by its long name)."""
    for mode in MODES.values():
        calls = [node for node in ast.walk(ast.parse((ROOT / mode.script).read_text()))
                 if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"]
        taken = [max((a.value for a in call.args if isinstance(a, ast.Constant)), key=len) for call in calls]
        assert sorted(taken) == sorted(COMMON_FLAGS + mode.flags), mode.script


def test_every_line_a_script_adds_to_its_parent_is_marked_with_its_idea(tmp_path):
    tool = load_script("tools/script_diffs.py")
    for a, b in tool.PAIRS:
        unmarked = tool.unmarked_hunks(ROOT, a, b)
        assert not unmarked, f"{a} -> {b}: hunks without '# {tool.PAIRS[a, b]}':\n" + "\n".join(unmarked[0])
    for name in ["01_single_gpu.py", "03_ddp_launch.py"]:  # the check itself: an unmarked change is found
        shutil.copy(ROOT / name, tmp_path / name)
    ddp = tmp_path / "03_ddp_launch.py"
    ddp.write_text(ddp.read_text().replace("dist.destroy_process_group()  # DDP", "dist.destroy_process_group()"))
    assert len(tool.unmarked_hunks(tmp_path, "01_single_gpu.py", "03_ddp_launch.py")) == 1


def script_diffs(root, *args):
    return subprocess.run([sys.executable, TOOL, "--root", root, *args], capture_output=True, text=True, timeout=60)


def test_diffs_and_excerpts_are_current():
    result = script_diffs(ROOT, "--check")
    assert result.returncode == 0, result.stderr


@pytest.fixture
def copy_of_the_docs(tmp_path):
    """The scripts, the README and docs/diffs/ in a folder of their own, regenerated there."""
    for name in [*NUMBERED, "README.md"]:
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "docs" / "diffs", tmp_path / "docs" / "diffs")
    assert script_diffs(tmp_path).returncode == 0
    assert script_diffs(tmp_path, "--check").returncode == 0
    return tmp_path


def test_a_stale_diff_is_caught(copy_of_the_docs):
    root = copy_of_the_docs
    script = root / "04_ddp_spawn.py"  # an edit the docs have not seen, on a line far from every excerpt
    script.write_text(script.read_text().replace("# seconds once", "# seconds (edited) once", 1))
    (root / "docs" / "diffs" / "01_single_gpu--99_gone.md").write_text("a pair that no longer exists\n")
    result = script_diffs(root, "--check")
    assert result.returncode == 1
    for stale in ["03_ddp_launch--04_ddp_spawn.md", "04_ddp_spawn--05_multinode_mnist.md",
                  "01_single_gpu--99_gone.md"]:
        assert f"docs/diffs/{stale}" in result.stderr, result.stderr
    assert "README.md" not in result.stderr  # the line is outside every excerpt
    assert script_diffs(root).returncode == 0 and script_diffs(root, "--check").returncode == 0
    assert not (root / "docs" / "diffs" / "01_single_gpu--99_gone.md").exists()


def test_an_edit_inside_an_excerpt_makes_the_readme_stale(copy_of_the_docs):
    root = copy_of_the_docs
    readme = (root / "README.md").read_text()
    shown = re.search(r"<!-- excerpt 01_single_gpu.py 03_ddp_launch.py: .*?```diff\n(.*?)```", readme, re.S)
    added = next(line[1:] for line in shown.group(1).splitlines() if line.startswith("+") and line[1:].strip())
    script = root / "03_ddp_launch.py"
    script.write_text(script.read_text().replace(added, added + "  # edited", 1))
    result = script_diffs(root, "--check")
    assert result.returncode == 1 and "stale: README.md" in result.stderr, result.stderr


def test_an_excerpt_that_selects_nothing_or_too_much_fails_with_one_line(copy_of_the_docs):
    root = copy_of_the_docs
    readme = (root / "README.md").read_text()
    for marker, expected in [("<!-- excerpt 01_single_gpu.py 03_ddp_launch.py: no such line -->",
                              "contains 'no such line'"),
                             ("<!-- excerpt 01_single_gpu.py: Net | MNIST -->", "more than 25")]:
        (root / "README.md").write_text(readme + f"\n{marker}\n<!-- end excerpt -->\n")
        result = script_diffs(root, "--check")
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr


def prose(path):
    """A page without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


def anchors(path):
    """The anchors a code host gives the headings of a Markdown page."""
    headings = re.findall(r"^#+ (.+)$", prose(path), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_and_path_the_docs_cite_exists():
    broken = []
    for page in PAGES + sorted((ROOT / "docs" / "diffs").glob("*.md")):
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
            if re.match(r"[a-z]+:", target):
                continue  # https: and the like
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
        for path in re.findall(r"`([\w.-]+/[\w./-]*)`", prose(page)):
            if path.split("/")[0] in TOP_LEVEL and not (ROOT / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: `{path}`")
    assert not broken, broken


def test_every_test_the_docs_cite_exists():
    tests = {}
    for file in (ROOT / "tests").rglob("test_*.py"):  # both tiers: tests/unit and tests/integration
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                tests[node.name] = tests.get(node.name, "") + file.read_text()  # a name in two files: either's cases
    record_keys = set(re.findall(r"\b(test_\w+)=", (ROOT / SCRIPTS[0]).read_text()))  # test_loss and the like
    cited = [(page, name, case) for page in PAGES
             for name, case in re.findall(r"`(test_\w+)(?:\[([^\]`]+)\])?`", prose(page)) if name not in record_keys]
    assert cited, "the docs cite no test"
    missing = [f"{page.relative_to(ROOT)}: {name}" + (f"[{case}]" if case else "") for page, name, case in cited
               if name not in tests or (case and f'"{case}"' not in tests[name])]
    assert not missing, missing


def test_the_legacy_launcher_takes_torchruns_arguments(monkeypatch):
    """torch.distributed.launch is torchrun's parser plus --use-env; without it the script gets --local-rank=N."""
    from torch.distributed import launch
    from torch.distributed.run import config_from_args, get_args_parser
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args would set it in this process
    legacy = launch.parse_args(["--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-backend", "c10d",
                                "--rdzv-endpoint", "node0:29400", "train.py", "--lr", "1"])
    assert (legacy.max_restarts, legacy.rdzv_backend) == (3, "c10d")
    assert vars(legacy).keys() == vars(get_args_parser().parse_args(["train.py"])).keys() | {"use_env"}
    assert config_from_args(legacy)[2] == ["-u", "train.py", "--local-rank=${local_rank}", "--lr", "1"]
    with_env = launch.parse_args(["--use-env", "--nproc-per-node", "2", "train.py"])
    assert "--local-rank=${local_rank}" not in config_from_args(with_env)[2]
    assert "deprecated" in launch.main.__deprecated__
    old_parser = argparse.ArgumentParser()
    old_parser.add_argument("--local_rank", type=int)
    with pytest.raises(SystemExit):  # what the posts' parser makes of it: "unrecognized arguments"
        old_parser.parse_args(["--local-rank=0"])


NCCL_WITHOUT_GPU = ["ProcessGroupNCCL is only supported with GPUs, no GPUs found!",  # torch 2.14
                    "nccl2 requires at least one CUDA device"]  # torch 2.15's new NCCL backend
NCCL_NOT_BUILT = "Distributed package doesn't have NCCL built in"


def test_backends_fail_with_the_messages_the_readme_quotes():
    readme = (ROOT / "README.md").read_text()
    assert all(message in readme for message in NCCL_WITHOUT_GPU) and NCCL_NOT_BUILT in readme
    assert NCCL_NOT_BUILT in Path(dist.__file__).with_name("distributed_c10d.py").read_text()
    assert dist.is_gloo_available()
    if not dist.is_nccl_available():
        pytest.skip("this PyTorch has no NCCL: it says so with the second message")
    program = ("import torch.distributed as dist; "
               "dist.init_process_group('nccl', init_method='tcp://127.0.0.1:PORT', rank=0, world_size=1)")
    result = run([sys.executable, "-c", program.replace("PORT", str(free_port()))], timeout=120, check=False)
    said = [message for message in NCCL_WITHOUT_GPU if message in result.stderr]  # this torch's, either release
    assert result.returncode != 0 and said, result.stderr  # tests see no GPU


def test_lightning_2_has_the_hooks_the_readme_names():
    lightning = pytest.importorskip("lightning", reason="07_lightning.py needs lightning (requirements.txt)",
                                    exc_type=ImportError)  # installed but broken: a skip too
    from lightning.pytorch.strategies import StrategyRegistry
    assert issubclass(lightning.LightningModule, torch.nn.Module)  # a subclass, not a superclass
    module = lightning.LightningModule
    assert all(hasattr(module, hook) for hook in ["training_step", "configure_optimizers", "train_dataloader",
                                                  "validation_step", "on_validation_epoch_end", "log"])
    assert not any(hasattr(module, hook) for hook in ["tng_dataloader", "configure_optimizer", "validation_end",
                                                      "update_tng_log_metrics"])
    strategies = StrategyRegistry.available_strategies()
    assert "ddp" in strategies and "ddp_spawn" in strategies and "dp" not in strategies


def test_pitfall_distributed_sampler_pads_the_test_set():
    """Why the scripts shard the test set themselves: DistributedSampler repeats images to even out the shards."""
    counted = sum(len(DistributedSampler(range(TEST_IMAGES), num_replicas=3, rank=r, shuffle=False)) for r in range(3))
    assert counted == TEST_IMAGES + 2


def test_the_readme_reads_top_to_bottom_within_320_lines():
    text = README.read_text()
    assert len(text.splitlines()) <= README_LINES, f"README.md: {len(text.splitlines())} lines"
    headings = re.findall(r"^## (.+)$", prose(README), re.M)
    order = [next((i for i, h in enumerate(headings) if h.startswith(s)), None) for s in SECTIONS]
    assert None not in order and order == sorted(order), list(zip(SECTIONS, order))
    glossary = text.index("## Words you will meet")
    glossary_end = text.index("\n## ", glossary + 1)
    rows = [line for line in GLOSSARY.read_text().splitlines() if line.startswith("| *")]
    terms = [re.fullmatch(r"\| \*([^*|]+)\* \| [^|]+ \|", row) for row in rows]
    assert all(terms), [row for row, term in zip(rows, terms) if not term]  # one term a row, then its meaning
    words = [term[1].lower() for term in terms]
    assert set(WORDS) <= set(words), set(WORDS) - set(words)
    shown = [line for line in text[glossary:glossary_end].splitlines() if line.startswith("| *")]
    assert shown and shown == rows[:len(shown)], "the README's words are not docs/glossary.md's first rows"
    for word in set(WORDS) & set(words[:len(shown)]):
        defined = text.find(f"*{word[0].upper()}{word[1:]}*", glossary, glossary_end)
        defined = defined if defined >= 0 else text.find(f"*{word}*", glossary, glossary_end)
        assert defined >= 0, f"{word!r} is not defined in Words you will meet"
        first = re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", prose(README), re.I)
        used = text.find(first.group(0)) if first else -1
        assert used == -1 or used >= glossary, f"{word!r} is used before Words you will meet"
        earlier = re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text[glossary:defined], re.I)
        assert not earlier, f"{word!r} is used in Words you will meet before it is defined"


def test_maintainer_material_lives_in_docs_maintainers_linked_once():
    readme = prose(README)
    cited = re.findall(r"`(test_\w+)", readme)
    assert not cited, f"README.md cites tests (their place is docs/maintainers.md): {cited}"
    assert readme.count("](docs/maintainers.md)") == 1
    maintainers = MAINTAINERS.read_text()
    assert "tools/script_diffs.py" in maintainers and "## Checklist" in maintainers
    assert "test_the_readme_reads_top_to_bottom_within_320_lines" in maintainers
