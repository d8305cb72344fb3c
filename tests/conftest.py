"""Shared test fixtures: a small learnable MNIST in torchvision's raw layout, and running scripts as a user does."""
import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the bench package, from the repository root
from bench.fake_mnist import write_fake_mnist  # noqa: E402  (a learnable MNIST in torchvision's raw layout)
from bench.machine import free_port  # noqa: E402,F401  (the harness's, for the tests' own jobs)
from bench.scripts import load_script  # noqa: E402,F401  (a numbered script as a module, to call its functions)
from bench.commands import TORCHRUN, launch  # noqa: E402,F401  (bench's torchrun; a mode's command)
from bench.processes import stop  # noqa: E402  (ends a command's whole process group)
from bench.scripts import MODES  # noqa: E402  (the table of modes: script, launcher, batch rule)

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["01_single_gpu.py", "02_data_parallel.py", "03_ddp_launch.py", "04_ddp_spawn.py", "05_multinode_mnist.py",
           "06_fault_tolerant.py"]
TRAIN_IMAGES, TEST_IMAGES = 4096, 10000  # TEST_IMAGES: the size of MNIST's real test split
QUICK_TEST_IMAGES = 1000  # the tests' test split: 10,000 would make evaluation most of a short run (1,000 too is
                          # not divisible by 3, so the exact-evaluation tests at world size 3 keep their point)
# Environment for runs that must not reach the network: any download attempt fails at once.
NO_NETWORK = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped where there is none)")
    config.addinivalue_line("markers", "slow: takes more than half a minute")
    config.addinivalue_line("markers", "slurm: needs root, SLURM and munge (skipped where they are missing)")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def quick_mnist_dir(tmp_path_factory):
    """A small learnable MNIST in torchvision's raw layout: TRAIN_IMAGES and QUICK_TEST_IMAGES images."""
    return Path(write_fake_mnist(str(tmp_path_factory.mktemp("mnist-quick")), train=TRAIN_IMAGES,
                                 test=QUICK_TEST_IMAGES))


def script_command(script, *args, nprocs=None, launcher=()):
    """The command a user types, as bench's table of modes starts the script: torchrun for 03, 06 and 08 (nprocs
    processes, default 1, launcher: torchrun's options); python for the others, and where nprocs is given 04's
    --nprocs or 07's --devices (05's two nodes: run_two_nodes)."""
    mode = {mode.script: mode for mode in MODES.values()}[script]
    return launch(mode, ROOT / script, nprocs, launcher) + [str(a) for a in args]


def launcher_env(world_size=1):
    """What torchrun sets for rank 0 of world_size processes, one per node: to start a DDP script by hand."""
    return dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def fake_command(bin_dir, name, answers):
    """A stand-in for a command such as nvidia-smi, first on the PATH this returns: for each argument line in
    answers (e.g. "topo -m") its canned output, exit status 1 for any other."""
    cases = "".join(f"  {shlex.quote(args)}) cat <<'EOF'\n{out}\nEOF\n    ;;\n" for args, out in answers.items())
    path = Path(bin_dir) / name
    path.write_text(f'#!/bin/sh\ncase "$*" in\n{cases}  *) exit 1 ;;\nesac\n')
    path.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def without_linux_only(tmp_path, root=ROOT):
    """The environment of a run in which the code under root cannot use what only Linux has (the hook in
    tests/no_linux_only), and the file to which each process of the run writes its pid and what it runs."""
    hook, log = Path(__file__).resolve().parent / "no_linux_only", Path(tmp_path) / "hooked.txt"
    path = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    return dict(PYTHONPATH=path, HIDDEN_FROM=str(root), HIDDEN_LOG=str(log)), log


STAND_IN = Path(__file__).resolve().parent / "stand_in_accelerator"
_hook = importlib.util.spec_from_file_location("stand_in_accelerator", STAND_IN / "sitecustomize.py")
stand_in_accelerator = importlib.util.module_from_spec(_hook)
_hook.loader.exec_module(stand_in_accelerator)  # its play(): the in-process stand-ins of tests/test_platforms.py


def with_stand_in_accelerator(tmp_path, kind, count=1):
    """The environment of a run on which torch reports `count` devices of `kind` ("cuda", "mps") and every real
    device call fails (the hook in tests/stand_in_accelerator), and the file to which each process of the run
    writes its pid and what it runs, and each device call it made."""
    log = Path(tmp_path) / f"stand-in-{kind}.txt"
    path = os.pathsep.join(filter(None, [str(STAND_IN), os.environ.get("PYTHONPATH")]))
    return dict(PYTHONPATH=path, STAND_IN_ACCELERATOR=kind, STAND_IN_COUNT=str(count), STAND_IN_LOG=str(log)), log


# Another set of CPU kernels than the tests run on (x86: ATen's scalar kernels and oneDNN's SSE4.1 ones, or AVX2 where
# the tests already run on the scalar ones): the same run there differs only by float rounding, other vector
# widths summing in another order. A mode's update compares with 01's within ROUNDING times that spread, per
# tensor: a bound from what rounding does to the reference on this CPU, not from one machine's result.
ROUNDING = 4  # measured: 08 at 3 ranks differs from 01 by up to 2.3 times 01's own spread (scalar/SSE4.1 kernels)


def other_kernels():
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        return {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    return {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}


def rounding_spread(reference, on_other_kernels):
    """Per tensor of a state dict, the largest difference between a run and the same run on other kernels."""
    return {name: (tensor - on_other_kernels[name]).abs().max().item() for name, tensor in reference.items()}


def assert_same_update(weights, reference, spread, msg=""):
    """The weights are the reference's, up to what float rounding does to it (ROUNDING x its spread, at least
    1e-5): an update summed instead of averaged, or a step missed, is far outside."""
    for name, tensor in reference.items():
        atol = max(1e-5, ROUNDING * spread[name])
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=atol,
                                   msg=lambda m: f"{msg} {name} (rounding's spread {spread[name]:.1e}): {m}")


# Tests see the CPU only, so that `pytest` checks the same behaviour on a GPU machine (tests marked gpu excepted).
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def run(command, timeout=180, env=None, check=True, **popen):
    """Run a command from the repository root; a hang fails the test instead of CI, and ends every process of
    the command (a torchrun or spawn parent killed alone would leave its workers using the CPU)."""
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **popen,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **CPU_ONLY, **(env or {})}) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop([proc])
            proc.communicate()
            raise
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check:
        assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        assert "Traceback" not in result.stderr, result.stderr
    return result


def start(command, env=None):
    """Start a command in the background (one "node" of a multi-node job)."""
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **CPU_ONLY, **(env or {})})


def run_two_nodes(*args, gpus=1, timeout=180, env=None):
    """05 as two "nodes" on this host: node 1 in the background, node 0 in front. Returns node 0's result."""
    port = free_port()
    common = ["-n", 2, "-g", gpus, "--master-port", port, *args]
    node1 = start(script_command("05_multinode_mnist.py", *common, "--nr", 1), env=env)
    try:
        node0 = run(script_command("05_multinode_mnist.py", *common, "--nr", 0), timeout=timeout, env=env)
        assert node1.wait(timeout=60) == 0, node1.communicate()
    finally:
        node1.kill()
    return node0


def evaluate_on_one_process(mnist_dir, weights):
    """What one process (01's code) makes of the given weights: the reference for distributed evaluations."""
    single = load_script("01_single_gpu.py")
    args = single.parse_args(["--data-dir", str(mnist_dir)])
    test_data = single.load_mnist(args, train=False)
    net = single.Net()
    net.load_state_dict(weights)
    return single.evaluate(net, test_data, range(len(test_data[1])), args, None)
