"""The copy checker's verdicts on records a copy's processes would write (tools/copy_hook's form), in this process:
a copier's mistake that keeps the sizes right must still be BROKEN. The checker run on real copies:
tests/integration/test_copying.py."""
import sys
import time

import pytest
import torch
from torch.utils.data import DistributedSampler

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import check_copy  # noqa: E402

TRAIN_ROWS = 1152


def sampler_record(rank, n, epochs, seed):
    """One process's record of its training sampler's orders, as the hook writes it."""
    sampler = DistributedSampler(range(TRAIN_ROWS), num_replicas=n, rank=rank, shuffle=True, seed=seed)
    orders = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        orders.append(dict(replicas=n, rank=rank, epoch=epoch, shuffle=True, length=TRAIN_ROWS,
                           indices=list(sampler)))
    return dict(samplers=orders)


@pytest.mark.parametrize("seed, said", [(1, ""), (2, "epoch 2, step 1: the resumed ranks trained other images")])
def test_a_resume_at_4_ranks_trains_each_steps_images_of_2_ranks_at_the_same_global_batch(seed, said):
    """DistributedSampler deals one shuffled order round the ranks: at 2 x 8 and 4 x 4, step k takes the same 16
    images. A resumed order of another shuffle (here another seed) trains other images from the step it resumed."""
    whole = [sampler_record(rank, 2, 2, seed=1) for rank in range(2)]
    resumed = [sampler_record(rank, 4, 2, seed=seed) for rank in range(4)]
    assert check_copy.same_images(whole, resumed, range(1, 4), (8, 4)).startswith(said)
    assert check_copy.same_images(whole, resumed, range(1, 4), (8, 8)) != ""  # a global batch of 32, not 16


@pytest.mark.parametrize("n", [2, 3, 5])
def test_shards_of_one_seed_are_disjoint_and_hold(n):
    held, said = check_copy.check_shards([sampler_record(rank, n, 2, seed=1) for rank in range(n)], n)
    assert held and f"{n} disjoint shards" in said, said


@pytest.mark.parametrize("n", [2, 3, 5])
def test_shards_of_the_right_size_that_overlap_are_broken(n):
    """A copier's mistake: each rank's sampler seeded with seed + rank. Every shard has its right size, but each
    rank shuffles the rows its own way, so the shards overlap and miss rows: only the rows themselves show it."""
    records = [sampler_record(rank, n, 2, seed=1 + rank) for rank in range(n)]
    assert sum(len(r["samplers"][0]["indices"]) for r in records) == -(-TRAIN_ROWS // n) * n  # the sizes hold
    held, said = check_copy.check_shards(records, n)
    assert held is False and "overlap or miss rows" in said, said


@pytest.mark.parametrize("test_rows", [250, 300, 500, 1000, 1152, 10000])
def test_the_rows_check_runs_where_a_padded_test_sampler_repeats_rows(test_rows):
    """At the world size the checker picks, torch's DistributedSampler pads the test set (300 rows: not at 3, 4, 5
    or 6 ranks, at 7), and the checker calls the padded copy BROKEN."""
    n = check_copy.world_size_for(test_rows)
    assert n >= 3 and test_rows % n, n
    shares = [list(DistributedSampler(range(test_rows), n, rank, shuffle=False)) for rank in range(n)]
    assert sum(map(len, shares)) > test_rows  # rows repeated
    records = [dict(eval_rows=2 * len(share)) for share in shares]  # two evaluations of each rank's share
    held, said = check_copy.check_rows(records, "", test_rows)
    assert held is False and "padded?" in said, said
    exact = [dict(eval_rows=2 * len(range(rank, test_rows, n))) for rank in range(n)]  # 03's strided rows
    assert check_copy.check_rows(exact, "", test_rows)[0] is True


@pytest.mark.parametrize("line, why", [
    ("transform = transforms.Compose([transforms.RandomCrop(28, padding=2), transforms.ToTensor()])",
     "a random augmentation"),
    ("self.norm = nn.BatchNorm2d(32)", "BatchNorm normalises each rank's own batch"),
    ("self.norm = nn.SyncBatchNorm(32)  # BatchNorm2d( across ranks", None),
    ("self.fc = nn.Linear(64, 4)  # no random draws: random.Random(seed) is the data's, not the model's", None)])
def test_an_update_that_cannot_match_is_not_checked_and_says_what_to_change(line, why, tmp_path):
    """2 x B cannot give 1 x 2B's update with a random augmentation on, or BatchNorm on the CPU: the checker says
    so (n/a, not BROKEN), before any run, and what to change to compare."""
    copy = tmp_path / "copy.py"
    copy.write_text(f"import torch.distributed as dist\ndist.init_process_group('gloo')\n{line}\n")
    if why is None:
        assert check_copy.cannot_match(copy.read_text()) == ""
        return
    held, said = check_copy.check_update(copy, "torchrun", [], tmp_path)  # it would fail if it ran the copy
    assert held is None and said.startswith("not checked: ") and why in said and "compare" in said, said


@pytest.mark.parametrize("said", [check_copy.EXIT_ABORT, check_copy.LOADER_HANG])
@pytest.mark.parametrize("aborts", [check_copy.AGAIN, check_copy.AGAIN + 1])
def test_a_run_torch_breaks_runs_again_from_an_empty_folder_at_most_again_times(aborts, said, tmp_path,
                                                                                monkeypatch):
    """torch's exit abort after a good run (06's worked copy, once in a whole-suite run), and a loader worker
    stuck in its fork (the 03-form copy, once), are not the copy's: the checker runs it again, with none of the
    failed attempt's files, AGAIN times at most; then it counts. The hook stands in as one that writes its
    record without importing torch, which costs 2 s a start."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import atexit, os\nout = os.environ['CHECK_COPY_OUT']\n"
        "atexit.register(lambda: open(os.path.join(out, f'{os.getpid()}.json'), 'w').write('{}'))\n")
    monkeypatch.setattr(check_copy, "HOOK", hook)
    count, folder = tmp_path / "count", tmp_path / "run"
    copy = tmp_path / "copy.py"
    copy.write_text(f"import os, sys\nif os.path.exists({str(folder / 'leftover')!r}):\n    sys.exit(5)\n"
                    f"open({str(folder / 'leftover')!r}, 'w').close()\nwith open({str(count)!r}, 'a') as f:\n"
                    f"    f.write('.')\nif len(open({str(count)!r}).read()) <= {aborts}:\n"
                    f"    sys.stderr.write({said!r})\n    sys.exit(1)\n")
    records, log = check_copy.run(copy, "single", 1, [], folder)
    assert count.read_text() == "." * min(aborts + 1, check_copy.AGAIN + 1), log
    if aborts <= check_copy.AGAIN:  # it ran: the hook's record of the last attempt alone
        assert records is not None and len(records) == 1, log
    else:
        assert records is None, log


class Stuck(torch.utils.data.Dataset):  # a worker that never answers in time, as one stuck in its fork
    def __len__(self):
        return 2

    def __getitem__(self, row):
        time.sleep(1.5)  # 3 s a batch: past the loader's timeout of 1 s, and its worker ends soon after
        return row


def test_a_loader_worker_that_never_answers_ends_the_run_with_the_words_the_checker_runs_again_on():
    """The worked copies' DataLoader(timeout=120): torch's error must say LOADER_HANG, or no run would run again."""
    with pytest.raises(RuntimeError, match=check_copy.LOADER_HANG):
        next(iter(torch.utils.data.DataLoader(Stuck(), 2, num_workers=1, timeout=1)))
