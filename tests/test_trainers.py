"""The trainers, run as a user runs them: they learn, agree with each other, and count every test image once."""
import json
import os
import runpy
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from conftest import (NO_NETWORK, QUICK_TEST_IMAGES, ROOT, SCRIPTS, evaluate_on_one_process,
                      launcher_env, load_script, run, run_two_nodes, script_command)

# Every key of the metrics record in the design contract (shared/DESIGN.md; docs/benchmark.md lists them too).
RECORD_KEYS = {"schema", "script", "mode", "device_type", "device_names", "world_size", "nodes", "backend",
               "per_device_batch", "global_batch", "lr", "epochs", "steps", "train_samples", "samples_per_s",
               "epochs_detail", "test_accuracy", "test_loss", "peak_memory_bytes", "synthetic", "torch_version", "argv"}
EPOCH_KEYS = {"epoch", "train_time_s", "train_loss", "test_loss", "test_accuracy", "test_samples"}
B = 32  # per-replica batch of the comparison runs; the single-process runs take 2 * B


def train_args(data_dir, out, *extra):
    return ["--data-dir", data_dir, "--metrics-json", out / "metrics.json", "--save-model", out / "model.pt",
            "--log-interval", 1, *extra]


def run_mode(script, data_dir, out, *extra, timeout=180):
    """Train with one script under the batch-size rules; returns (stdout of the printing rank(s), record, weights)."""
    out.mkdir(parents=True, exist_ok=True)
    args = train_args(data_dir, out, *extra)
    if script.startswith("01") or script.startswith("02"):
        result = run(script_command(script, *args, "--batch-size", 2 * B), timeout=timeout)
    elif script.startswith(("03", "06")):
        result = run(script_command(script, *args, "--batch-size", B, nprocs=2), timeout=timeout)
    elif script.startswith("04"):
        result = run(script_command(script, *args, "--batch-size", B, "--nprocs", 2), timeout=timeout)
    else:  # two nodes of two processes: the global rank must be node rank x 2 + local rank
        result = run_two_nodes(*args, "--batch-size", B // 2, gpus=2, timeout=timeout)
    record = json.loads((out / "metrics.json").read_text())
    return result.stdout, record, torch.load(out / "model.pt")


@pytest.fixture(scope="module")
def same_batch_runs(quick_mnist_dir, tmp_path_factory):
    """Every mode at global batch 2B for two short epochs, dropout off so that the updates can be compared."""
    tmp = tmp_path_factory.mktemp("same-batch")
    extra = ["--epochs", 2, "--max-steps", 3, "--no-dropout"]
    return {script: run_mode(script, quick_mnist_dir, tmp / script, *extra) for script in SCRIPTS}


def test_same_global_batch_gives_the_same_update(same_batch_runs):
    reference_record, reference = same_batch_runs["01_single_gpu.py"][1:]
    for script, (_, record, weights) in same_batch_runs.items():
        assert record["global_batch"] == 2 * B and record["steps"] == 6
        # The same mean loss per sample: a sum weighted by batch size, divided by all samples of all ranks.
        for mine, reference_epoch in zip(record["epochs_detail"], reference_record["epochs_detail"]):
            assert mine["train_loss"] == pytest.approx(reference_epoch["train_loss"], rel=1e-4), script
        assert 1.0 < record["epochs_detail"][0]["train_loss"] < 3.0, "chance is ln 10 = 2.3"
        for name, tensor in reference.items():
            torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-5, msg=f"{script}: {name}")


def test_metrics_record_is_complete_and_consistent(same_batch_runs):
    for script, (_, record, _) in same_batch_runs.items():
        assert RECORD_KEYS <= record.keys(), f"{script} misses {RECORD_KEYS - record.keys()}"
        assert record["script"] == script and record["schema"] == 1
        assert record["per_device_batch"] * record["world_size"] == record["global_batch"]
        assert record["train_samples"] == record["steps"] * record["global_batch"]
        assert [e["epoch"] for e in record["epochs_detail"]] == [1, 2]
        assert all(EPOCH_KEYS <= e.keys() and e["test_samples"] == QUICK_TEST_IMAGES for e in record["epochs_detail"])
        # Warm-up steps (5, capped so one step is timed) are left out of the throughput of epoch 1 only.
        warmup_samples = 2 * record["global_batch"]
        assert record["steady_samples"] == record["train_samples"] - warmup_samples
        assert record["samples_per_s"] == pytest.approx(record["steady_samples"] / record["steady_time_s"])
        assert record["steady_time_s"] < sum(e["train_time_s"] for e in record["epochs_detail"])
        assert record["peak_memory_bytes"] > 0 and record["synthetic"] is False


def test_distributed_modes_record_their_world(same_batch_runs):
    cores = len(os.sched_getaffinity(0))
    expected = {"01_single_gpu.py": ("single", 1, 1), "02_data_parallel.py": ("dp", 1, 1),
                "03_ddp_launch.py": ("ddp_launch", 2, 1), "04_ddp_spawn.py": ("ddp_spawn", 2, 1),
                "05_multinode_mnist.py": ("ddp_multinode", 4, 2), "06_fault_tolerant.py": ("ddp_fault_tolerant", 2, 1)}
    for script, (mode, world_size, nodes) in expected.items():
        record = same_batch_runs[script][1]
        assert (record["mode"], record["world_size"], record["nodes"]) == (mode, world_size, nodes)
        if world_size > 1:
            assert record["backend"] == "gloo"
            # Processes on one host split its cores (two "nodes" on one host each think they own it).
            assert record["threads"] == max(1, cores // (world_size // nodes))


def test_only_rank_zero_prints_epoch_lines(same_batch_runs):
    for script, (stdout, _, _) in same_batch_runs.items():
        assert stdout.count("epoch 2:") == 1, f"{script}:\n{stdout}"
        assert stdout.count("epoch 2 step 0/") == 1, f"{script}:\n{stdout}"


LAUNCHES = {  # world size: how 03 is started
    1: lambda args: script_command("03_ddp_launch.py", *args, nprocs=1),
    # The deprecated launcher, as 03's docstring shows it (--use-env: no --local-rank argument).
    2: lambda args: [sys.executable, "-m", "torch.distributed.launch", "--use-env", "--nproc_per_node", "2",
                     str(ROOT / "03_ddp_launch.py"), *map(str, args)],
    3: lambda args: script_command("03_ddp_launch.py", *args, nprocs=3),  # 3 does not divide 1,000
}


@pytest.mark.parametrize("world_size", LAUNCHES, ids=["torchrun-1", "legacy-launcher-2", "torchrun-3"])
def test_evaluation_counts_every_test_image_once(world_size, quick_mnist_dir, tmp_path):
    """Test batches of 100: each rank's share ends in a short batch."""
    args = train_args(quick_mnist_dir, tmp_path, "--max-steps", 3, "--batch-size", B, "--test-batch-size", 100)
    run(LAUNCHES[world_size](args))
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["world_size"] == world_size
    reference = evaluate_on_one_process(quick_mnist_dir, torch.load(tmp_path / "model.pt"))
    accuracy, loss, count = reference["test_accuracy"], reference["test_loss"], reference["test_samples"]
    assert record["epochs_detail"][0]["test_samples"] == count == QUICK_TEST_IMAGES
    assert record["test_accuracy"] == accuracy
    assert record["test_loss"] == pytest.approx(loss, rel=1e-6)


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


def test_one_process_per_node_downloads_and_a_missing_dataset_fails_clearly(tmp_path):
    result = run(script_command("03_ddp_launch.py", "--data-dir", tmp_path, nprocs=2), env=NO_NETWORK, check=False)
    assert result.returncode != 0
    assert result.stderr.count("MNIST could not be loaded") == 1, result.stderr  # rank 1 waited, it did not try
    assert "--synthetic" in result.stderr


def test_taking_a_batch_costs_under_2_percent_of_a_training_step(quick_mnist_dir):
    """The input pipeline is never what is measured: time spent getting batches while 01 trains."""
    single = load_script("01_single_gpu.py")
    args = single.parse_args(["--data-dir", str(quick_mnist_dir), "--log-interval", "0", "--max-steps", "30",
                              "--cpu"])
    ctx = single.setup(args)
    data = [t.to(ctx["device"]) for t in single.load_mnist(args, train=True)]
    sampler = single.DistributedSampler(range(len(data[1])), num_replicas=1, rank=0, seed=1)
    net = single.Net().to(ctx["device"])
    spent = []
    real_batches = single.batches

    def timed_batches(*batches_args):
        batches = real_batches(*batches_args)
        while True:
            start = time.perf_counter()
            batch = next(batches, None)
            spent.append(time.perf_counter() - start)
            if batch is None:
                return
            yield batch

    single.batches = timed_batches  # this module object only: the script itself is untouched
    train = single.train_epoch(net, data, sampler, torch.optim.Adadelta(net.parameters()), args, ctx, epoch=2)
    assert train["steps"] == 30
    assert sum(spent) <= 0.02 * train["train_time_s"], f"{sum(spent):.4f} s of {train['train_time_s']:.2f} s"


def test_the_slowest_rank_sets_the_clock_and_the_sums_cover_every_rank(quick_mnist_dir, monkeypatch):
    """03's train_epoch with a stand-in for the all-reduce: a second rank that trained as much, 5 s slower."""
    ddp = load_script("03_ddp_launch.py")
    args = ddp.parse_args(["--data-dir", str(quick_mnist_dir), "--log-interval", "0", "--max-steps", "3"])
    ctx = dict(device=torch.device("cpu"), devices=[torch.device("cpu")], master=True)
    monkeypatch.setattr(ddp, "all_ranks",
                        lambda value, device, op=dist.ReduceOp.SUM: float(value) + 5 if op == dist.ReduceOp.MAX
                        else 2 * float(value))
    data = ddp.load_mnist(args, train=True)
    sampler = ddp.DistributedSampler(range(len(data[1])), 2, 0, seed=1)
    net = ddp.Net()
    train = ddp.train_epoch(net, data, sampler, torch.optim.Adadelta(net.parameters()), args, ctx, epoch=1)
    assert train["train_time_s"] >= 5 and train["steady_time_s"] >= 5
    assert train["train_samples"] == 2 * 3 * args.batch_size
