"""07_lightning.py, run as a user runs it: two processes take 01's steps at twice the batch, every
test image is counted once (Lightning's sampler would pad), 01's metrics record and output, bad
input ends in one line, and a bug keeps its traceback."""
import ast
import json
import os
import re
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import (NO_NETWORK, QUICK_TEST_IMAGES, ROOT, assert_same_update, evaluate_on_one_process,
                      load_script, other_kernels, rounding_spread, run, script_command)
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


def in_this_process(script, argv):
    """07's `if __name__` lines, in this process (no subprocess: none imports Lightning again)."""
    args = script.parse_args([str(a) for a in argv])
    script.run(args, script.setup(args))


def outcome(result, out):
    record = json.loads((out / "metrics.json").read_text())
    return SimpleNamespace(stdout=result.stdout, stderr=result.stderr, record=record,
                           weights=torch.load(out / "model.pt"))


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
    assert (record["mode"], record["script"]) == ("lightning", SCRIPT)
    assert (record["world_size"], record["nodes"], record["backend"]) == (2, 1, "gloo")
    assert record["threads"] == max(1, cores() // 2)  # Lightning's share of the cores
    assert record["lr"] == single["lr"]
    assert record["per_device_batch"] * 2 == record["global_batch"] == 2 * B
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
    assert all(line.startswith(("epoch ", "lightning: ")) for line in lines), lit.stdout
    shape = [re.sub(r"\d+(\.\d+)?", "N", line) for line in single.stdout.splitlines()[:-1]]
    assert [re.sub(r"\d+(\.\d+)?", "N", line) for line in lines[:-1]] == shape  # 01's lines
    assert lit.stdout.count("epoch 2:") == 1 and lit.stdout.count("epoch 2 step 0 loss") == 1
    assert lines[-1].startswith("lightning: ") and "world size 2, cpu" in lines[-1]
    assert not [word for word in NOISE if word in lit.stdout + lit.stderr], lit.stderr


@pytest.fixture(scope="module")
def lightning_script():
    return load_script(SCRIPT)


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


def test_one_device_evaluates_like_01(lightning_script, quick_mnist_dir, tmp_path):
    """In this process (no process group: Lightning's single-device strategy), on the quick set;
    on the CPU, like every test's subprocess (conftest.CPU_ONLY)."""
    in_this_process(lightning_script, train_args(quick_mnist_dir, tmp_path, "--max-steps", 2,
                                                 "--cpu"))
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


# Bad input, each in this process (a subprocess would spend seconds importing Lightning per case),
# on the CPU unless the case asks for GPUs:
# id: (arguments, what the one error line must say, environment)
BAD = {
    "devices 0": (["--devices", "0"], "argument --devices: must be in [1, inf), got 0", {}),
    "num-nodes 0": (["--num-nodes", "0"], "argument --num-nodes: must be in [1, inf)", {}),
    "accelerator tpu": (["--accelerator", "tpu"], "argument --accelerator: invalid choice", {}),
    "strategy bogus": (["--strategy", "bogus"], "argument --strategy: invalid choice: 'bogus'", {}),
    "learning rate not a number": (["--lr", "nan"], "argument --lr: must be in [0.0, inf), got nan",
                                   {}),
    "batch size 0": (["--batch-size", "0"], "argument --batch-size: must be in [1, inf)", {}),
    "more GPUs than there are": (["--accelerator", "gpu", "--devices", "99"],
                                 "99 processes on this machine but", {}),
    "devices unlike torchrun's": ([], "give --devices 2 --num-nodes 1",
                                  {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "RANK": "0"}),
    "batch larger than the data": (["--batch-size", "5000"], "more than the 4096 images", {}),
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
    cpu = [] if "gpu" in args else ["--cpu"]
    argv = ["--data-dir", data_dir, "--metrics-json", metrics, "--max-steps", "2", *cpu,
            *[a.format(tmp=tmp_path) for a in args]]
    with pytest.raises(SystemExit) as exited:
        in_this_process(lightning_script, argv)
    # As the interpreter ends on sys.exit("error: ..."): the message on stderr, exit status 1.
    message = exited.value.code
    assert isinstance(message, str), message
    result = SimpleNamespace(returncode=1, stderr=capsys.readouterr().err + message + "\n")
    assert_fails_clearly(result, expected)
    assert all(p.read_bytes() == content for p, content in before.items()), "a file changed"


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
    assert not [line for line in result.stderr.splitlines() if line.startswith("error:")]


# What torch 2.14.1 raises when a peer dies or a collective times out (gloo: plain RuntimeErrors,
# as seen with two processes), and what it raises for a bug.
LOST = {
    "peer died (gloo)": RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed "
        "by peer [127.0.0.1]:64730. This is typically caused by a remote worker crashing."),
    "peer reset (gloo)": RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
        "[127.0.0.1]:61109: Connection reset by peer."),
    "timeout (gloo)": RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
        "waiting 5000ms for recv operation to complete"),
    "NCCL": torch.distributed.DistBackendError("NCCL communicator was aborted on rank 1."),
    "store": torch.distributed.DistStoreError("wait timeout after 30000ms"),
    "network": torch.distributed.DistNetworkError("The client socket has timed out"),
    "join": TimeoutError("timed out waiting for all 2 members to join"),
}
BUGS = {
    "shape": RuntimeError("mat1 and mat2 shapes cannot be multiplied (64x9216 and 9215x128)"),
    "out of memory": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "type": TypeError("linear(): argument 'input' (position 1) must be Tensor, not list"),
}


def test_only_a_lost_peer_or_a_timeout_is_said_in_one_line(lightning_script):
    assert all(lightning_script.lost_peer(e) for e in LOST.values())
    assert not any(lightning_script.lost_peer(e) for e in BUGS.values())
