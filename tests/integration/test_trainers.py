"""The trainers, run as a user runs them: they learn, agree with each other, and count every test image once
(their parts in this process: tests/unit/test_trainer_parts.py)."""
import ast
import json
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from helpers import (EPOCH_KEYS, NO_NETWORK, Lazy, QUICK_TEST_IMAGES, RECORD_KEYS, ROOT, SCRIPTS, TORCHRUN,
                     assert_same_update, by_script, evaluate_on_one_process, load_script, other_kernels,
                     rounding_spread, run, run_two_nodes, script_command, train_args, without_the_measurement)

B = 32  # per-replica batch of the comparison runs; the single-process runs take 2 * B


def run_mode(script, data_dir, out, *extra, timeout=180):
    """Train with one script under the batch-size rules; returns (stdout of the printing rank(s), record, weights)."""
    out.mkdir(parents=True, exist_ok=True)
    args = train_args(data_dir, out, *extra)
    mode = by_script(script)
    if mode.launch.nodes > 1:  # two nodes of two processes: the global rank is node rank x 2 + local rank
        result = run_two_nodes(*args, "--batch-size", B // 2, gpus=2, timeout=timeout)
    elif not mode.collective or mode.batch.shared:  # one process, or ranks that share it: the whole global batch
        result = run(script_command(script, *args, "--batch-size", 2 * B, nprocs=2 if mode.collective else None),
                     timeout=timeout)
    else:  # data-parallel groups of B, 2 of them: 11's are pairs of tensor-parallel ranks, so 4 processes
        result = run(script_command(script, *args, "--batch-size", B, nprocs=2 * mode.batch.shared_by),
                     timeout=timeout)
    record = json.loads((out / "metrics.json").read_text())
    return result.stdout, record, torch.load(out / "model.pt")


@pytest.fixture(scope="module")
def same_batch_runs(quick_mnist_dir, tmp_path_factory):
    """Every mode at global batch 2B for two short epochs, dropout off so that the updates can be compared. Each is
    run when a test first asks for it; the guarantee table (tests/guarantees.py) names the tests that use them."""
    tmp = tmp_path_factory.mktemp("same-batch")
    extra = ["--epochs", 2, "--max-steps", 3, "--no-dropout"]

    return Lazy(lambda script: run_mode(script, quick_mnist_dir, tmp / script, *extra))


ALIKE = [script for script in SCRIPTS if not by_script(script).needs]  # 07's: tests/integration/test_lightning.py


@pytest.fixture(scope="module")
def rounding(same_batch_runs, quick_mnist_dir, tmp_path_factory):
    """What float rounding does to 01's run of same_batch_runs: its spread against itself on other CPU kernels."""
    with pytest.MonkeyPatch.context() as kernels:
        for key, value in other_kernels().items():
            kernels.setenv(key, value)
        other = run_mode(SCRIPTS[0], quick_mnist_dir, tmp_path_factory.mktemp("other-kernels"), "--epochs", 2,
                         "--max-steps", 3, "--no-dropout")
    return rounding_spread(same_batch_runs[SCRIPTS[0]][2], other[2])


@pytest.mark.parametrize("script", ALIKE)
def test_same_global_batch_gives_the_same_update(script, same_batch_runs, rounding):
    reference_record, reference = same_batch_runs["01_single_gpu.py"][1:]
    _, record, weights = same_batch_runs[script]
    assert record["global_batch"] == 2 * B and record["steps"] == 6
    # The same mean loss per sample: a sum weighted by batch size, divided by all samples of all ranks.
    for mine, reference_epoch in zip(record["epochs_detail"], reference_record["epochs_detail"]):
        assert mine["train_loss"] == pytest.approx(reference_epoch["train_loss"], rel=1e-4), script
    assert 1.0 < record["epochs_detail"][0]["train_loss"] < 3.0, "chance is ln 10 = 2.3"
    assert_same_update(weights, reference, rounding, msg=script)


def test_on_the_cpu_a_ranks_update_is_01s_on_one_thread_and_two_threads_round_otherwise(same_batch_runs,
                                                                                     quick_mnist_dir, tmp_path):
    """The README's way to see 01's update: torchrun gives each process one thread, so compare with 01 --threads 1.
    01 on two threads sums in another order: not bitwise 01 on one. Both stay within rounding of it; which one is
    closer varies from run to run (6.0e-8 and 4.6e-7 in one, 7.5e-8 and 6.0e-8 in another)."""
    _, _, ddp = same_batch_runs["03_ddp_launch.py"]
    single = {threads: run_mode(SCRIPTS[0], quick_mnist_dir, tmp_path / str(threads), "--epochs", 2, "--max-steps", 3,
                                "--no-dropout", "--threads", threads)[2] for threads in (1, 2)}
    apart, threads_apart = (max(rounding_spread(single[1], other).values()) for other in (ddp, single[2]))
    assert threads_apart > 0 and apart < 1e-6, (apart, threads_apart)


@pytest.mark.parametrize("script", ALIKE)
def test_every_test_image_is_scored_once_and_the_saved_model_is_01s(script, same_batch_runs, quick_mnist_dir):
    """Every rank's share of the test split counted, none twice; the file --save-model wrote is one plain state dict
    of 01's Net, on the CPU, that scores in one process what the run's own evaluation said."""
    _, record, weights = same_batch_runs[script]
    assert [e["test_samples"] for e in record["epochs_detail"]] == [QUICK_TEST_IMAGES] * 2
    net = load_script("01_single_gpu.py").Net()
    assert weights.keys() == net.state_dict().keys()
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in weights.values())  # no DTensor
    reference = evaluate_on_one_process(quick_mnist_dir, weights)
    assert record["test_accuracy"] == reference["test_accuracy"], script
    assert record["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-6), script


def test_metrics_record_is_complete_and_consistent(same_batch_runs):
    for script in ALIKE:
        _, record, _ = same_batch_runs[script]
        assert RECORD_KEYS <= record.keys(), f"{script} misses {RECORD_KEYS - record.keys()}"
        assert record["schema"] == 1
        batch = by_script(script).batch  # n x B, or 09's one batch B that every rank shares
        per_device = 2 * B if batch.one_loader or batch.shared else 2 * B * batch.shared_by // record["world_size"]
        assert batch.global_batch(per_device, record["world_size"]) == record["global_batch"]
        assert record["train_samples"] == record["steps"] * record["global_batch"]
        assert [e["epoch"] for e in record["epochs_detail"]] == [1, 2]
        assert all(EPOCH_KEYS <= e.keys() and e["test_samples"] == QUICK_TEST_IMAGES for e in record["epochs_detail"])
        # Warm-up steps (5, capped so one step is timed) are left out of the throughput of epoch 1 only.
        warmup_samples = 2 * record["global_batch"]
        assert record["steady_samples"] == record["train_samples"] - warmup_samples
        assert record["samples_per_s"] == pytest.approx(record["steady_samples"] / record["steady_time_s"])
        assert record["steady_time_s"] < sum(e["train_time_s"] for e in record["epochs_detail"])
        assert record["peak_memory_bytes"] is None  # on a GPU: test_gpu.py


def test_distributed_modes_record_their_world(same_batch_runs):
    expected = {"01_single_gpu.py": (1, 1), "02_data_parallel.py": (1, 1), "03_ddp_launch.py": (2, 1),
                "04_ddp_spawn.py": (2, 1), "05_multinode_mnist.py": (4, 2), "06_fault_tolerant.py": (2, 1),
                "08_fsdp.py": (2, 1), "09_tensor_parallel.py": (2, 1), "10_pipeline_parallel.py": (2, 1)}
    for script, (world_size, nodes) in expected.items():
        record = same_batch_runs[script][1]
        assert (record["world_size"], record["nodes"]) == (world_size, nodes), script
        if world_size > 1:
            assert record["backend"] == "gloo"
            # One thread per process unless --threads says otherwise: torchrun's OMP_NUM_THREADS=1, which
            # 04 and 05 set as torchrun does, so that n processes do not each take every core.
            assert record["threads"] == 1


@pytest.mark.parametrize("script", ALIKE)
def test_only_rank_zero_prints_epoch_lines(script, same_batch_runs):
    stdout = same_batch_runs[script][0]
    assert stdout.count("epoch 2:") == 1, f"{script}:\n{stdout}"
    assert stdout.count("epoch 2 step 0 ") == 1, f"{script}:\n{stdout}"


LAUNCHES = {  # world size: how 03 is started
    1: lambda args: script_command("03_ddp_launch.py", *args, nprocs=1),
    # The deprecated launcher (--use-env: no --local-rank argument).
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


def test_one_process_per_node_downloads_and_a_missing_dataset_fails_clearly(tmp_path):
    result = run(script_command("03_ddp_launch.py", "--data-dir", tmp_path, nprocs=2), env=NO_NETWORK, check=False)
    assert result.returncode != 0
    assert result.stderr.count("cannot load MNIST") == 1, result.stderr  # rank 1 waited, it did not try
    assert "MNIST/raw/" in result.stderr  # the way out offline


@pytest.mark.parametrize("script", ["01_single_gpu.py", "03_ddp_launch.py"])
def test_deleting_the_measurement_leaves_a_script_that_trains(script, quick_mnist_dir, tmp_path):
    copy = tmp_path / script
    copy.write_text(without_the_measurement(script))
    for name in ["timed", "write_record", "clock", "WARMUP_STEPS", "epochs_detail"]:
        assert not re.search(rf"\b{name}\b", copy.read_text()), f"{name} is left in the copy"
    args = ["--data-dir", quick_mnist_dir, "--max-steps", 15, "--log-interval", 0, "--save-model",
            tmp_path / "model.pt"]
    launcher = TORCHRUN + ["--standalone", "--nproc_per_node=2"] if script.startswith("03") else [sys.executable]
    result = run([*launcher, copy, *map(str, args)], timeout=180)
    accuracy = float(re.search(r"epoch 1: train loss [\d.]+, accuracy ([\d.]+)%", result.stdout).group(1))
    assert accuracy > 50, result.stdout  # chance is 10%
    assert "samples/s" not in result.stdout and (tmp_path / "model.pt").exists()


def replaced(source, name, new_definition):
    """source with its top-level definition `name` replaced by new_definition."""
    node = next(n for n in ast.parse(source).body if getattr(n, "name", None) == name)
    lines = source.splitlines()
    return "\n".join(lines[:node.lineno - 1] + new_definition.strip("\n").splitlines() + lines[node.end_lineno:])


# What a copier puts into 03: a model of their own with BatchNorm, and data of another shape (3 x 32 x 32).
OWN_MODEL = """
class Net(nn.Module):
    \"\"\"A small CNN for 3 x 32 x 32 images, with BatchNorm.\"\"\"

    def __init__(self, dropout=True):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x):
        x = F.relu(self.norm(self.conv(x)))
        x = F.max_pool2d(x, 2)
        return self.fc(torch.flatten(x, 1))
"""
OWN_DATA = """
class MNIST(Dataset):
    \"\"\"10 classes of 3 x 32 x 32 images, each a pattern plus noise; each rank's camera brighter than the
    last, so that each rank's BatchNorm statistics are its own.\"\"\"

    def __init__(self, args, train, device):
        patterns = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        rng = torch.Generator().manual_seed(1 + train)
        n = 640 if train else 250
        self.labels = torch.randint(0, 10, (n,), generator=rng)
        brighter = 5.0 * dist.get_rank() if train and dist.is_initialized() else 0.0
        self.images = patterns[self.labels] + 2 * torch.randn(n, 3, 32, 32, generator=rng) + brighter

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, row):
        return self.images[row], self.labels[row]


def collate(batch):
    \"\"\"The DataLoader's collate_fn: rows stacked into a batch.\"\"\"
    return torch.utils.data.default_collate(batch)
"""


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_copy_with_its_own_model_and_data_keeps_every_guarantee(world_size, tmp_path):
    """03 with BatchNorm and 3 x 32 x 32 data in about 30 changed lines: every test image is scored once, by
    rank 0's model (its running statistics too), which is the model saved. Each rank trains on images of another
    brightness: scored with its own statistics, a rank's share would change the loss by far more than 1e-5."""
    copy = tmp_path / "my_train.py"
    source = replaced(replaced((ROOT / "03_ddp_launch.py").read_text(), "Net", OWN_MODEL), "collate", "")
    copy.write_text(replaced(source, "MNIST", OWN_DATA))
    tool = load_script("tools/script_diffs.py")
    assert tool.changed_lines(tool.unified(tmp_path, str(ROOT / "03_ddp_launch.py"), copy.name, 0)) <= 60
    run([*TORCHRUN, "--standalone", f"--nproc_per_node={world_size}", copy, "--epochs", "2", "--batch-size", "16",
         "--log-interval", "0", "--metrics-json", tmp_path / "m.json", "--save-model", tmp_path / "model.pt"])
    record = json.loads((tmp_path / "m.json").read_text())
    mine, single = load_script(str(copy)), load_script("01_single_gpu.py")  # 01 scores on one process
    args = mine.parse_args([])
    net = mine.Net()
    net.load_state_dict(torch.load(tmp_path / "model.pt"))
    cpu = torch.device("cpu")
    test_batches = mine.batches(mine.MNIST(args, False, cpu), range(250), 100, 0)
    reference = single.evaluate(net, test_batches, SimpleNamespace(device=cpu))
    assert all(e["test_samples"] == 250 for e in record["epochs_detail"])
    assert record["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-5)
    assert record["test_accuracy"] == reference["test_accuracy"] > 0.5  # it learned: chance is 0.1


def test_each_rank_draws_its_own_dropout_masks(quick_mnist_dir, tmp_path):
    """A copy of 03 that prints, after its first forward pass, the next number its generator would give. Both
    ranks drew as many numbers (the same model, the same batch shape), so equal numbers mean equal masks."""
    copy = tmp_path / "03_ddp_launch.py"
    step = "        loss = F.cross_entropy(output, labels.to(world.device, non_blocking=True))\n"
    source = (ROOT / "03_ddp_launch.py").read_text()
    assert source.count(step) == 1
    # One write of the whole line: the tests' PYTHONUNBUFFERED makes print write each argument on its own, and
    # two ranks' arguments could interleave; one write (under PIPE_BUF) cannot be split, only placed anywhere.
    draw = '        print(f"next draw {world.rank} {torch.rand(1).item()} end")\n'
    copy.write_text(source.replace(step, step + draw))
    result = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", copy, "--data-dir", quick_mnist_dir,
                  "--max-steps", "1", "--log-interval", "0"])
    draws = dict(re.findall(r"next draw (\d) (\S+) end", result.stdout))
    assert draws.keys() == {"0", "1"} and draws["0"] != draws["1"], result.stdout
