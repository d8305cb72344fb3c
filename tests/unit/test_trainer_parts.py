"""The trainers' parts, in this process: each epoch its own shuffle, batches that cost next to nothing, warm-up
left out of the throughput, and the slowest rank's clock (the trainers run as a user runs them:
tests/integration/test_trainers.py; one short run of each mode: tests/integration/test_each_mode_runs.py)."""
import runpy
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from helpers import ROOT, SCRIPTS, TRAIN_IMAGES, launcher_env, load_script


def test_each_epoch_has_its_own_shuffle_and_the_group_is_destroyed(quick_mnist_dir, monkeypatch):
    """03 run in this process as `python 03_ddp_launch.py` under a launcher, a world of one: the first training
    batch of each of two epochs is recorded as the sampler hands out its order."""
    seen = []
    real_iter = DistributedSampler.__iter__

    def recording_iter(sampler):  # evaluation takes no sampler: every call is training's
        order = list(real_iter(sampler))
        seen.append(order[:8])
        return iter(order)

    monkeypatch.setattr(DistributedSampler, "__iter__", recording_iter)
    for key, value in launcher_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", ["03_ddp_launch.py", "--data-dir", str(quick_mnist_dir), "--epochs", "2",
                                      "--max-steps", "2", "--batch-size", "8", "--log-interval", "0", "--cpu"])
    runpy.run_path(str(ROOT / "03_ddp_launch.py"), run_name="__main__")
    assert len(seen) == 2 and seen[0] != seen[1]
    assert not dist.is_initialized()


def test_taking_a_batch_costs_under_2_percent_of_a_training_step(quick_mnist_dir):
    """The input pipeline is never what is measured: time spent getting batches while 01 trains."""
    single = load_script("01_single_gpu.py")
    args = single.parse_args(["--data-dir", str(quick_mnist_dir), "--log-interval", "0", "--cpu", "--max-steps", "30"])
    world = single.setup(args)
    training, _ = single.load_data(args, 0, 1, world.device)
    net = single.Net().to(world.device)
    spent = []

    def timed_batches(batches):
        while True:
            start = time.perf_counter()
            batch = next(batches, None)
            spent.append(time.perf_counter() - start)
            if batch is None:
                return
            yield batch

    start = time.perf_counter()
    single.train_epoch(net, timed_batches(iter(training(2))),
                       torch.optim.Adadelta(net.parameters()), args, world, epoch=2)
    train_time_s = time.perf_counter() - start
    assert len(spent) == 31  # 30 batches, then the end
    assert sum(spent) <= 0.02 * train_time_s, f"{sum(spent):.4f} s of {train_time_s:.2f} s"


class FakeClock:
    """A stand-in for a script's clock(): each training step takes `seconds(step)`, as the test says."""

    def __init__(self, seconds):
        self.now, self.seconds, self.step = 0.0, seconds, 0

    def __call__(self, device):
        return self.now

    def steps(self, batches):
        for batch in batches:
            yield batch
            self.now += self.seconds(self.step)
            self.step += 1


def timed_epochs(script, clock, world, steps, monkeypatch, epochs=1):
    """The script's timed() over `steps` batches of 4 images per epoch, each step timed by clock."""
    module = load_script(script)
    monkeypatch.setattr(module, "clock", clock)
    record = []
    batches = [(torch.zeros(4, 1, 28, 28), torch.zeros(4, dtype=torch.long))] * steps
    for _ in range(epochs):
        for _ in clock.steps(module.timed(iter(batches), world, record)):
            pass
    return record


def test_warm_up_steps_are_left_out_of_the_throughput(monkeypatch):
    """Warm-up steps that take 10 s each, then steps of 1 s: the steady time holds only the latter."""
    clock = FakeClock(lambda step: 10.0 if step < 5 else 1.0)
    world = SimpleNamespace(device=torch.device("cpu"), world_size=1)
    first, second = timed_epochs("01_single_gpu.py", clock, world, steps=12, epochs=2, monkeypatch=monkeypatch)
    assert (first["train_time_s"], first["steady_time_s"], first["steady_samples"]) == (57.0, 7.0, 7 * 4)
    assert (second["train_time_s"], second["steady_time_s"], second["steady_samples"]) == (1.0 * 12, 12.0, 48)
    short = timed_epochs("01_single_gpu.py", FakeClock(lambda step: 10.0 if step < 2 else 1.0), world, steps=3,
                         monkeypatch=monkeypatch)[0]
    assert (short["steady_time_s"], short["steady_samples"]) == (1.0, 4)  # at least one step is timed


def test_the_slowest_rank_sets_the_clock_and_the_sums_cover_every_rank(monkeypatch):
    """03's timed() with a stand-in for the all-reduce: a second rank that trained as much, 5 s slower."""
    def all_reduce(tensor, op=dist.ReduceOp.SUM):
        assert op == dist.ReduceOp.MAX, "only the time needs the other ranks: every rank trains as many samples"
        tensor += 5.0
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # a group of two, as torchrun would start
    world = SimpleNamespace(device=torch.device("cpu"), world_size=2)
    epoch = timed_epochs("03_ddp_launch.py", FakeClock(lambda step: 1.0), world, steps=8,
                         monkeypatch=monkeypatch)[0]
    assert (epoch["train_time_s"], epoch["steady_time_s"]) == (8.0 + 5, 3.0 + 5)
    assert (epoch["train_samples"], epoch["steady_samples"]) == (2 * 8 * 4, 2 * 3 * 4)


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_epoch_is_only_full_batches_and_a_batch_larger_than_the_share_is_refused(script, quick_mnist_dir):
    """Each script's load_data, for rank 0 of 3 (4,096 images: a share of 1,366) at a batch that does not divide
    it: a short last batch would be a step of another size, and the record's samples would be wrong. A batch
    larger than the share trains nothing: one line, not an empty epoch."""
    m = load_script(script)
    args = m.parse_args(["--data-dir", str(quick_mnist_dir), "--cpu", "--batch-size", "100"])
    args.max_steps = 0  # every full batch of the epoch
    training, *_ = m.load_data(args, 0, 3, torch.device("cpu"))  # 06: and its steps
    sizes = [len(labels) for _, labels in training(*[1, 0][:training.__code__.co_argcount])]  # 06: (epoch, first)
    assert sizes == [100] * (-(-TRAIN_IMAGES // 3) // 100), sizes  # 13 full batches of the 1,366
    args.batch_size = 2000
    with pytest.raises(SystemExit, match="is more than the 1366 samples"):
        m.load_data(args, 0, 3, torch.device("cpu"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_mnist_on_the_device_is_what_the_report_takes_off_the_peak(script, quick_mnist_dir):
    """Each process keeps both splits on its device; the report's "peak less MNIST" takes off MNIST_BYTES.
    Random data has MNIST's sizes; real files, here a small MNIST, the same bytes per row."""
    from bench.report import MNIST_BYTES
    mnist = load_script(script).MNIST
    sizes = {}
    for synthetic in (True, False):
        args = SimpleNamespace(synthetic=synthetic, seed=1, data_dir=str(quick_mnist_dir))
        splits = [mnist(args, train, torch.device("cpu")) for train in (True, False)]
        sizes[synthetic] = (sum(len(s) for s in splits),
                            sum(t.nbytes for s in splits for t in (s.images, s.labels)))
    assert sizes[True] == (70000, MNIST_BYTES)
    assert sizes[False][1] * 70000 == MNIST_BYTES * sizes[False][0]
