"""07_lightning.py, run as a user runs it: two processes take 01's steps at twice the batch, every
test image is counted once (Lightning's sampler would pad), 01's metrics record and output, and a bug
keeps its traceback (07 in this process, its bad input too: tests/unit/test_lightning_in_process.py)."""
import os
import re
import sys

import pytest

from helpers import (QUICK_TEST_IMAGES, ROOT, assert_same_update, error_lines, evaluate_on_one_process, other_kernels,
                     outcome, rounding_spread, run, script_command, train_args)

pytest.importorskip("lightning", reason="07_lightning.py needs lightning (requirements.txt)",
                    exc_type=ImportError)  # installed but broken: a skip too (pytest 9.1)

SCRIPT = "07_lightning.py"
B = 32  # per-process batch; 01 takes 2 * B
# What Lightning prints unless told not to; none of it may reach the user.
NOISE = ["GPU available", "LOCAL_RANK", "Initializing distributed", "distributed_backend", "srun",
         "does not have many workers", "Trainer.fit stopped", "Params", "it/s]", "Warning"]


def lightning(*args, devices=1, torchrun=False):
    """07's command line: Lightning starts the processes, or torchrun does."""
    script = [str(ROOT / SCRIPT), *map(str, args), "--devices", str(devices)]
    if not torchrun:
        return [sys.executable, *script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={devices}", *script]


def cores():
    """What Lightning divides among the processes it starts on this machine."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@pytest.fixture(scope="module")
def same_steps(quick_mnist_dir, tmp_path_factory):
    """01 at batch 2B and 07 in two processes at batch B: two short epochs, dropout off."""
    tmp = tmp_path_factory.mktemp("lightning-same-steps")
    extra = ["--epochs", 2, "--max-steps", 3, "--no-dropout"]
    runs = {}
    for name, command, batch, env in [("01", script_command("01_single_gpu.py"), 2 * B, None),
                                      ("07", lightning(devices=2), B, None),  # and 01 on other CPU kernels:
                                      ("01 other", script_command("01_single_gpu.py"), 2 * B, other_kernels())]:
        out = tmp / name
        out.mkdir()
        result = run(command + [str(a) for a in train_args(quick_mnist_dir, out, *extra)]
                     + ["--batch-size", str(batch)], env=env)
        runs[name] = outcome(result, out)
    return runs


def test_two_processes_take_01s_steps_at_twice_the_batch(same_steps):
    single, lit = same_steps["01"], same_steps["07"]
    assert lit.record["global_batch"] == 2 * B
    assert lit.record["steps"] == single.record["steps"] == 6
    assert_same_update(lit.weights, single.weights, rounding_spread(single.weights, same_steps["01 other"].weights))
    for mine, theirs in zip(lit.record["epochs_detail"], single.record["epochs_detail"]):
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-5)
        assert mine["test_loss"] == pytest.approx(theirs["test_loss"], rel=1e-4)
        assert abs(mine["test_accuracy"] - theirs["test_accuracy"]) <= 1 / QUICK_TEST_IMAGES


def test_metrics_record_has_01s_keys_and_meanings(same_steps):
    single, record = same_steps["01"].record, same_steps["07"].record
    assert record.keys() == single.keys()
    assert all(e.keys() == single["epochs_detail"][0].keys() for e in record["epochs_detail"])
    assert (record["world_size"], record["nodes"], record["backend"]) == (2, 1, "gloo")
    assert record["threads"] == max(1, cores() // 2)  # Lightning's share of the cores
    assert record["global_batch"] == 2 * B
    assert record["train_samples"] == record["steps"] * record["global_batch"]
    # Two warm-up steps (5, capped so one step is timed) are left out of epoch 1 only, as in 01.
    assert record["steady_samples"] == record["train_samples"] - 2 * record["global_batch"]
    steady_rate = record["steady_samples"] / record["steady_time_s"]
    assert record["samples_per_s"] == pytest.approx(steady_rate)
    assert [e["epoch"] for e in record["epochs_detail"]] == [1, 2]
    assert [e["test_samples"] for e in record["epochs_detail"]] == [QUICK_TEST_IMAGES] * 2


def test_output_is_01s_without_lightnings_noise(same_steps):
    lit, single = same_steps["07"], same_steps["01"]
    # torch 2.10's gloo prints each rank's connections (unbuffered, so two ranks' lines can interleave): torch's
    # words, not Lightning's, and gone in later releases.
    lines = [line for line in lit.stdout.splitlines() if "connected peer ranks" not in line]
    assert all(line.startswith(("epoch ", "07_lightning.py: ")) for line in lines), lit.stdout
    shape = [re.sub(r"\d+(\.\d+)?", "N", line) for line in single.stdout.splitlines()[:-1]]
    assert [re.sub(r"\d+(\.\d+)?", "N", line) for line in lines[:-1]] == shape  # 01's lines
    assert lit.stdout.count("epoch 2:") == 1 and lit.stdout.count("epoch 2 step 0 loss") == 1
    assert lines[-1].startswith("07_lightning.py: ") and "world size 2, cpu" in lines[-1]
    assert not [word for word in NOISE if word in lit.stdout + lit.stderr], lit.stderr


def test_evaluation_counts_every_test_image_once_at_world_size_3(quick_mnist_dir, tmp_path):
    """3 does not divide 1,000: Lightning's own sampler would count 1,002 images here."""
    args = train_args(quick_mnist_dir, tmp_path, "--max-steps", 3, "--batch-size", B,
                      "--test-batch-size", 100)
    lit = outcome(run(lightning(*args, devices=3, torchrun=True)), tmp_path)
    assert lit.record["world_size"] == 3
    reference = evaluate_on_one_process(quick_mnist_dir, lit.weights)
    counted = lit.record["epochs_detail"][0]["test_samples"]
    assert counted == reference["test_samples"] == QUICK_TEST_IMAGES
    assert lit.record["test_accuracy"] == reference["test_accuracy"]
    assert lit.record["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-6)


def test_a_bug_keeps_its_traceback(quick_mnist_dir, tmp_path):
    """A copier's shape error (fc1 one input short) is no lost peer: Python's traceback, from the
    command line, and no error line that would hide it."""
    source = (ROOT / SCRIPT).read_text()
    assert source.count("nn.Linear(9216, 128)") == 1
    planted = tmp_path / SCRIPT
    planted.write_text(source.replace("nn.Linear(9216, 128)", "nn.Linear(9215, 128)"))
    result = run([sys.executable, str(planted), "--data-dir", str(quick_mnist_dir),
                  "--max-steps", "1", "--cpu"], check=False, timeout=120)
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr, result.stderr
    assert "x = self.fc1(x)" in result.stderr  # the line that failed, in the planted copy
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied"), last
    assert not error_lines(result.stderr)


