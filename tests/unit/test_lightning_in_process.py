"""07_lightning.py in this process: one device evaluates like 01, only 07 imports lightning, bad input ends in one
line, and only a lost peer or a timeout is said in one line (07 run as a user runs it, two and three processes, a
bug's traceback: tests/integration/test_lightning.py)."""
import ast
import shutil
from types import SimpleNamespace

import pytest
import torch

from helpers import (NO_NETWORK, QUICK_TEST_IMAGES, ROOT, assert_fails_clearly, evaluate_on_one_process, load_script,
                     outcome, train_args)

pytest.importorskip("lightning", reason="07_lightning.py needs lightning (requirements.txt)",
                    exc_type=ImportError)  # installed but broken: a skip too (pytest 9.1)

SCRIPT = "07_lightning.py"
pytestmark = pytest.mark.filterwarnings("ignore:The `srun` command")  # in-process runs


def in_this_process(script, argv):
    """07's `if __name__` lines, in this process (no subprocess: none imports Lightning again)."""
    args = script.parse_args([str(a) for a in argv])
    script.run(args, script.setup(args))


@pytest.fixture(scope="module")
def lightning_script():
    return load_script(SCRIPT)


def test_one_device_evaluates_like_01(lightning_script, quick_mnist_dir, tmp_path):
    """In this process (no process group: Lightning's single-device strategy), on the quick set;
    on the CPU, like every test's subprocess (helpers.CPU_ONLY)."""
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
    "batch larger than the data": (["--batch-size", "5000"], "more than the 4096 samples", {}),
    "data missing": (["--data-dir", "{tmp}/nothing-here"], "MNIST/raw/", NO_NETWORK),
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
