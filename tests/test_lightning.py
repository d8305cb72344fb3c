"""07_lightning.py, run as a user runs it: two processes take 01's steps at twice the batch, every
test image is counted once (Lightning's sampler would pad), 01's metrics record and output, and bad
input ends in one line."""
import ast
import json
import os
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import (NO_NETWORK, QUICK_TEST_IMAGES, ROOT, evaluate_on_one_process, load_script,
                      run, script_command)
from test_bad_input import assert_fails_clearly

pytest.importorskip("lightning", reason="07_lightning.py needs lightning (requirements.txt)")

SCRIPT = "07_lightning.py"
pytestmark = pytest.mark.filterwarnings("ignore:The `srun` command")  # in-process runs
B = 32  # per-process batch; 01 takes 2 * B
# What Lightning prints unless told not to; none of it may reach the user.
NOISE = ["GPU available", "LOCAL_RANK", "Initializing distributed", "distributed_backend", "srun",
         "does not have many workers", "Trainer.fit stopped", "Params", "it/s]", "Warning"]


def train_args(data_dir, out, *extra):
    return ["--data-dir", data_dir, "--metrics-json", out / "metrics.json",
            "--save-model", out / "model.pt", "--log-interval", 1, *extra]


def lightning(*args, devices=1, torchrun=False):
    """07's command line: Lightning starts the processes, or torchrun does."""
    script = [str(ROOT / SCRIPT), *map(str, args), "--devices", str(devices)]
    if not torchrun:
        return [sys.executable, *script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={devices}", *script]


def outcome(result, out):
    record = json.loads((out / "metrics.json").read_text())
    return SimpleNamespace(stdout=result.stdout, stderr=result.stderr, record=record,
                           weights=torch.load(out / "model.pt"))


@pytest.fixture(scope="module")
def same_steps(quick_mnist_dir, tmp_path_factory):
    """01 at batch 2B and 07 in two processes at batch B: two short epochs, dropout off."""
    tmp = tmp_path_factory.mktemp("lightning-same-steps")
    extra = ["--epochs", 2, "--max-steps", 3, "--no-dropout"]
    runs = {}
    for name, command, batch in [("01", script_command("01_single_gpu.py"), 2 * B),
                                 ("07", lightning(devices=2), B)]:
        out = tmp / name
        out.mkdir()
        result = run(command + [str(a) for a in train_args(quick_mnist_dir, out, *extra)]
                     + ["--batch-size", str(batch)])
        runs[name] = outcome(result, out)
    return runs


def test_two_processes_take_01s_steps_at_twice_the_batch(same_steps):
    single, lit = same_steps["01"], same_steps["07"]
    assert lit.record["global_batch"] == 2 * B
    assert lit.record["steps"] == single.record["steps"] == 6
    for name, tensor in single.weights.items():
        torch.testing.assert_close(lit.weights[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    for mine, theirs in zip(lit.record["epochs_detail"], single.record["epochs_detail"]):
        assert mine["lr"] == theirs["lr"]
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-5)
        assert mine["test_loss"] == pytest.approx(theirs["test_loss"], rel=1e-4)
        assert abs(mine["test_accuracy"] - theirs["test_accuracy"]) <= 1 / QUICK_TEST_IMAGES


def test_metrics_record_has_01s_keys_and_meanings(same_steps):
    single, record = same_steps["01"].record, same_steps["07"].record
    assert record.keys() == single.keys()
    assert all(e.keys() == single["epochs_detail"][0].keys() for e in record["epochs_detail"])
    assert (record["mode"], record["script"]) == ("lightning", SCRIPT)
    assert (record["world_size"], record["nodes"], record["backend"]) == (2, 1, "gloo")
    assert record["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
    assert record["per_device_batch"] * 2 == record["global_batch"] == 2 * B
    assert record["train_samples"] == record["steps"] * record["global_batch"]
    # Two warm-up steps (5, capped so one step is timed) are left out of epoch 1 only, as in 01.
    assert record["steady_samples"] == record["train_samples"] - 2 * record["global_batch"]
    steady_rate = record["steady_samples"] / record["steady_time_s"]
    assert record["samples_per_s"] == pytest.approx(steady_rate)
    assert [e["epoch"] for e in record["epochs_detail"]] == [1, 2]
    assert [e["test_samples"] for e in record["epochs_detail"]] == [QUICK_TEST_IMAGES] * 2


def test_output_is_01s_without_lightnings_noise(same_steps):
    lit = same_steps["07"]
    lines = lit.stdout.splitlines()
    assert all(line.startswith(("epoch ", "lightning: ")) for line in lines), lit.stdout
    assert lit.stdout.count("epoch 2:") == 1  # rank 0 only
    assert lit.stdout.count("epoch 2 step 0/3") == 1
    assert lines[-1].startswith("lightning: ") and "world size 2, cpu" in lines[-1]
    assert not [word for word in NOISE if word in lit.stdout + lit.stderr], lit.stderr


@pytest.fixture(scope="module")
def lightning_script():
    return load_script(SCRIPT)


def test_evaluation_counts_every_test_image_once_at_world_size_3(quick_mnist_dir, tmp_path):
    """3 does not divide 1,000: Lightning's own sampler would count 1,002 images here."""
    args = train_args(quick_mnist_dir, tmp_path, "--max-steps", 3, "--batch-size", B, "--test-batch-size", 100)
    lit = outcome(run(lightning(*args, devices=3, torchrun=True)), tmp_path)
    assert lit.record["world_size"] == 3
    reference = evaluate_on_one_process(quick_mnist_dir, lit.weights)
    counted = lit.record["epochs_detail"][0]["test_samples"]
    assert counted == reference["test_samples"] == QUICK_TEST_IMAGES
    assert lit.record["test_accuracy"] == reference["test_accuracy"]
    assert lit.record["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-6)


def test_one_device_evaluates_like_01(lightning_script, quick_mnist_dir, tmp_path):
    """In this process (no process group: Lightning's single-device strategy), on the quick set;
    on the CPU, like every test's subprocess (conftest.CPU_ONLY)."""
    args = train_args(quick_mnist_dir, tmp_path, "--max-steps", 2, "--cpu")
    lightning_script.main([str(a) for a in args])
    lit = outcome(SimpleNamespace(stdout="", stderr=""), tmp_path)
    assert (lit.record["world_size"], lit.record["backend"]) == (1, None)
    reference = evaluate_on_one_process(quick_mnist_dir, lit.weights)
    assert lit.record["epochs_detail"][0]["test_samples"] == QUICK_TEST_IMAGES
    assert lit.record["test_accuracy"] == reference["test_accuracy"]
    assert lit.record["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-6)


def test_only_07_needs_lightning():
    """01-06 run with torch and torchvision alone."""
    for script in sorted(ROOT.glob("0[0-9]_*.py")):
        imported = set()
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
        assert ("lightning" in imported) == (script.name == SCRIPT), script.name


# Bad input, each in this process (a subprocess would spend seconds importing Lightning per case):
# id: (arguments, what the one error line must say, environment)
BAD = {
    "devices 0": (["--devices", "0"], "--devices must be positive", {}),
    "num-nodes 0": (["--num-nodes", "0"], "--num-nodes must be positive", {}),
    "accelerator tpu": (["--accelerator", "tpu"], "--accelerator must be auto or cpu or gpu", {}),
    "batch size 0": (["--batch-size", "0"], "--batch-size must be positive", {}),
    "more GPUs than there are": (["--accelerator", "gpu", "--devices", "99"],
                                 "--devices 99 needs 99 GPUs", {}),
    "devices unlike torchrun's": ([], "--devices 2 --num-nodes 1",
                                  {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "RANK": "0"}),
    "batch larger than the data": (["--batch-size", "5000"], "more than the 4096 training", {}),
    "data missing": (["--data-dir", "{tmp}/nothing-here"], "--synthetic", NO_NETWORK),
    "metrics folder missing": (["--metrics-json", "{tmp}/missing/m.json"], "cannot write", {}),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_fails_with_one_clear_line(case, lightning_script, quick_mnist_dir, tmp_path,
                                             monkeypatch, capsys):
    args, expected, env = BAD[case]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    data_dir = tmp_path / "data"
    shutil.copytree(quick_mnist_dir, data_dir)
    metrics = tmp_path / "metrics.json"
    metrics.write_text('{"earlier": "run"}')
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    argv = ["--data-dir", str(data_dir), "--metrics-json", str(metrics), "--max-steps", "2",
            "--cpu", *[a.format(tmp=tmp_path) for a in args]]
    with pytest.raises(SystemExit) as exited:
        lightning_script.main(argv)
    result = SimpleNamespace(returncode=exited.value.code, stderr=capsys.readouterr().err)
    assert_fails_clearly(result, expected)
    assert exited.value.code == 2
    assert all(p.read_bytes() == content for p, content in before.items()), "a file changed"


def test_a_bad_strategy_fails_with_one_clear_line_from_the_command_line(tmp_path):
    metrics = tmp_path / "metrics.json"
    metrics.write_text('{"earlier": "run"}')
    command = lightning("--strategy", "bogus", "--metrics-json", metrics)
    result = run(command, check=False, timeout=120)
    assert_fails_clearly(result, "--strategy must be auto or ddp or ddp_spawn, got bogus")
    assert result.returncode == 2 and metrics.read_text() == '{"earlier": "run"}'
