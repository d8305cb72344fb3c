"""What the tests share: running scripts and the harness as a user does, the test MNIST's sizes, and checks that
more than one test file makes. Test files import from here (`from helpers import ...`), never from each other;
tests/conftest.py holds only pytest's hooks and fixtures."""
import ast
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the bench package, from the repository root
from bench import plan  # noqa: E402  (the harness's Settings, for the tests' own)
from bench.checks import EXIT_ABORT, EXIT_ABORT_AGAIN  # noqa: E402  (torch's abort at a worker's exit)
from bench.fake_mnist import write_fake_mnist  # noqa: E402,F401  (a learnable MNIST in torchvision's raw layout)
from bench.machine import free_port  # noqa: E402  (the harness's, for the tests' own jobs)
from bench.family import MODES, by_script, load_script  # noqa: E402,F401  (the family table; a script as a module)
from bench.commands import TORCHRUN, launch  # noqa: E402,F401  (bench's torchrun; a mode's command)
from bench.processes import stop  # noqa: E402  (ends a command's whole process group)

SCRIPTS = [mode.script for mode in MODES.values()]  # the family, in reading order (bench/family.py)
TRAIN_IMAGES, TEST_IMAGES = 4096, 10000  # TEST_IMAGES: the size of MNIST's real test split
QUICK_TEST_IMAGES = 1000  # the tests' test split: 10,000 would make evaluation most of a short run (1,000 too is
                          # not divisible by 3, so the exact-evaluation tests at world size 3 keep their point)
# 08's test batch: at world size 3 rank 0 tests 334 of the 1,000 images, ranks 1 and 2 333; in batches of 111,
# 03's loop would give rank 0 a fourth batch (of one image): one forward, one all-gather of each layer, more.
FSDP_TEST_BATCH = 111
# Environment for runs that must not reach the network: any download attempt fails at once.
NO_NETWORK = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
# Every start-up hook the tests put on PYTHONPATH: a folder whose sitecustomize.py first runs the next one on it
# (tools/startup_hook.py), so that they stack. tests/README.md says what each does.
HOOKS = {name: ROOT / "tests" / path for name, path in [
    ("as_on_cuda", "as_on_cuda"), ("fast_start", "fast_start"), ("no_linux_only", "no_linux_only"),
    ("stand_in_accelerator", "stand_in_accelerator"), ("torch_2_15_spawn", "torch_2_15_spawn"),
    ("rank_weights", "integration/rank_weights"), ("loaded_state", "integration/loaded_state")]}


def on_pythonpath(*hooks):
    """PYTHONPATH with these hooks (names of HOOKS, or folders) first, then this process's own."""
    folders = [str(HOOKS.get(hook, hook)) for hook in hooks]
    return os.pathsep.join(filter(None, [*folders, os.environ.get("PYTHONPATH")]))


STAND_IN = HOOKS["stand_in_accelerator"]
_hook = importlib.util.spec_from_file_location("stand_in_accelerator", STAND_IN / "sitecustomize.py")
stand_in_accelerator = importlib.util.module_from_spec(_hook)
_hook.loader.exec_module(stand_in_accelerator)  # its play(): the in-process stand-ins of tests/test_platforms.py


def with_stand_in_accelerator(tmp_path, kind, count=1):
    """The environment of a run on which torch reports `count` devices of `kind` ("cuda", "mps") and every real
    device call fails (the hook in tests/stand_in_accelerator), and the file to which each process of the run
    writes its pid and what it runs, and each device call it made."""
    log = Path(tmp_path) / f"stand-in-{kind}.txt"
    return dict(PYTHONPATH=on_pythonpath("stand_in_accelerator"), STAND_IN_ACCELERATOR=kind, STAND_IN_COUNT=str(count), STAND_IN_LOG=str(log)), log


def as_on_cuda(tmp_path, *more_hooks):
    """The environment of a run in which the CPU takes CUDA's default paths (the hook in tests/as_on_cuda: the
    optimizers' foreach path, cuDNN's rounding, host reads and copies counted), more_hooks' folders after it on
    PYTHONPATH, and the file to which each process writes what the hook saw, one JSON line each."""
    log = Path(tmp_path) / "as-on-cuda.jsonl"
    return dict(PYTHONPATH=on_pythonpath("as_on_cuda", *more_hooks), AS_ON_CUDA_LOG=str(log)), log


def trained_as_on_cuda(log, world_size):
    """The hook's line of each process that trained, one per rank: not torchrun's agent, nor spawn's parent (10's
    stage 1 runs no convolution, but copies its batches)."""
    lines = [json.loads(line) for line in Path(log).read_text().splitlines()]
    training = [line for line in lines if line["conv_grads"] or "train_epoch" in line["copies"]]
    assert len(training) == world_size, lines  # the hook ran in every rank
    return training


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


def load_per_core():
    """This machine's 1-minute load average per core (None where the OS keeps none): over 1, processes that could
    run wait for a core, and a wall-time bound measured on a quiet machine may not hold."""
    return os.getloadavg()[0] / (os.cpu_count() or 1) if hasattr(os, "getloadavg") else None


def slack(seconds, most=4):
    """seconds of slack measured on a quiet machine, stretched by how busy this one is (its load per core, at most
    `most` times): for work that only waits for a core, never for a wait a bug would add (keep such bounds fixed)."""
    return seconds * min(most, max(1.0, load_per_core() or 1.0))


def busy_note():
    """What a failed wall-time bound says about the machine: a busy one may explain it (then rerun the test alone)."""
    load = load_per_core()
    if load is None:
        return "no load average on this OS"
    said = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    return said + (": the machine was busy, rerun this test alone" if load > 1 else ": a quiet machine")

# Every key of the metrics record in the design contract (shared/DESIGN.md; docs/benchmark.md lists them too).
RECORD_KEYS = {"schema", "script", "mode", "device_type", "device_names", "world_size", "nodes", "backend",
               "per_device_batch", "global_batch", "lr", "epochs", "steps", "train_samples", "samples_per_s",
               "epochs_detail", "test_accuracy", "test_loss", "peak_memory_bytes", "synthetic", "torch_version", "argv"}
EPOCH_KEYS = {"epoch", "train_time_s", "train_loss", "test_loss", "test_accuracy", "test_samples"}


# Killed (the GPU check's bound, CI's), a pytest that uses these helpers unwinds as after Ctrl-C: each test's
# finally and run() below end the process groups they started (in sessions of their own, which a signal to
# pytest's group does not reach). Here, not in conftest.py: a test outside tests/ that imports run() gets it too.
signal.signal(signal.SIGTERM, signal.default_int_handler)


# ---- the numbered scripts, started as a user starts them

class Lazy(dict):
    """{key: make(key)}, each made when a test first asks for it: a run that several tests read, started only if
    one of them is selected."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = self.make(key)
        return self[key]


def script_command(script, *args, nprocs=None, launcher=()):
    """The command a user types, as bench's table of modes starts the script: torchrun for 03, 06 and 08 (nprocs
    processes, default 1, launcher: torchrun's options); python for the others, and where nprocs is given 04's
    --nprocs or 07's --devices (05's two nodes: run_two_nodes)."""
    return launch(by_script(script), ROOT / script, nprocs, launcher) + [str(a) for a in args]


def processes_for(mode, least=2):
    """The fewest processes, at least `least`, that a mode of process groups runs with in a CPU sweep (its row's
    runs_with): 2 for most, 4 for 11's 2 x 2 mesh."""
    return next(n for n in range(least, 65) if mode.runs_with(n, True))


def train_args(data_dir, out, *extra):
    """A short training's flags: the record to out/metrics.json, the weights to out/model.pt, a line per step."""
    return ["--data-dir", data_dir, "--metrics-json", out / "metrics.json", "--save-model", out / "model.pt",
            "--log-interval", 1, *extra]


def outcome(result, out):
    """A finished run's output, and the record and weights train_args had it write to out."""
    record = json.loads((out / "metrics.json").read_text())
    return SimpleNamespace(stdout=result.stdout, stderr=result.stderr, record=record,
                           weights=torch.load(out / "model.pt"))


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


# nvidia-smi's answers on a machine of two GPUs, 40 GB of GPU 0 held by another process (the fixture two_gpus).
NVIDIA_SMI = {
    "--query-gpu=index,uuid,name --format=csv,noheader": "0, GPU-aaaa, NVIDIA H200\n1, GPU-bbbb, NVIDIA H200",
    "--query-gpu=index,uuid,memory.used --format=csv,noheader,nounits": "0, GPU-aaaa, 40321\n1, GPU-bbbb, 1",
    "--query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits":
        "GPU-aaaa, 4242, /usr/bin/python3, 40310",
    "topo -m": "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV18\t0-15\nGPU1\tNV18\t X \t0-15\n\nLegend:\n  X = Self",
}


def without_linux_only(tmp_path, root=ROOT):
    """The environment of a run in which the code under root cannot use what only Linux has (the hook in
    tests/no_linux_only), and the file to which each process of the run writes its pid and what it runs."""
    log = Path(tmp_path) / "hooked.txt"
    return dict(PYTHONPATH=on_pythonpath("no_linux_only"), HIDDEN_FROM=str(root), HIDDEN_LOG=str(log)), log


# PyTorch's own abort at a worker's exit, after it finished (bench.checks.EXIT_ABORT). Seen twice on CI (09), and
# in whole-suite runs on the dev VM (08: once twice in a row; 06's worked copy). A checked run that ends so runs
# again, with a warning, at most AGAIN times.
AGAIN = EXIT_ABORT_AGAIN


def run(command, timeout=180, env=None, check=True, on_again=None, _again=AGAIN, **popen):
    """Run a command from the repository root; a hang fails the test instead of CI, and ends every process of
    the command (a torchrun or spawn parent killed alone would leave its workers using the CPU). on_again: what to
    undo before a run again after torch's exit abort (a log the processes append to)."""
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **popen,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **CPU_ONLY, **(env or {})}) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:  # a timeout, or pytest interrupted (Ctrl-C, SIGTERM): not one process left behind
            stop([proc])
            proc.communicate()
            raise
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check and result.returncode != 0 and EXIT_ABORT in stderr and _again:
        warnings.warn(f"{command}: torch aborted a worker at exit ({EXIT_ABORT}); run again")
        if on_again:
            on_again()
        return run(command, timeout, env, check, on_again, _again - 1, **popen)
    if check:
        assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        assert "Traceback" not in result.stderr, result.stderr
    return result


def start(command, env=None):
    """Start a command in the background (one "node" of a multi-node job), in a process group of its own: end it
    with stop([process]), which ends what it started too (torchrun's or spawn's workers)."""
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
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
        stop([node1])
    return node0


def without_the_measurement(script):
    """The script's text as a copier leaves it who deletes the fenced block and the lines marked '# measure' (the
    deletion tools/copy_size.py counts copies against)."""
    lines = load_script("tools/copy_size.py").without_measurement((ROOT / script).read_text())
    assert len(lines) < len((ROOT / script).read_text().splitlines()) - 20
    return "\n".join(lines) + "\n"


def evaluate_on_one_process(mnist_dir, weights):
    """What one process (01's code) makes of the given weights: the reference for distributed evaluations."""
    single = load_script("01_single_gpu.py")
    args = single.parse_args(["--data-dir", str(mnist_dir)])
    cpu = torch.device("cpu")
    _, testing = single.load_data(args, 0, 1, cpu)
    net = single.Net()
    net.load_state_dict(weights)
    return single.evaluate(net, testing(), SimpleNamespace(device=cpu))


def definitions(script):
    """{name: source} of each top-level function and class of a script."""
    source = (ROOT / script).read_text()
    return {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


# ---- bad input: one line on stderr, nothing already written damaged

def error_lines(stderr):
    """Each "error: ..." message in stderr, one an item. Python writes sys.exit's message and its newline in two
    writes, so ranks that refuse at once can run their lines together ("error: Aerror: A"): split those apart."""
    return [message for line in stderr.splitlines() if line.startswith("error:")
            for message in re.split(r"(?=error: )", line) if message]


def assert_fails_clearly(result, expected):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and expected in errors[0], result.stderr


EARLIER = '{"earlier": "run"}'


def with_an_earlier_metrics_file(args, tmp_path):
    """(the case's arguments with {tmp} filled in, and --metrics-json unless it names one, that file):
    the file holds an earlier run's record, which a refused run must leave as it was."""
    metrics = tmp_path / "metrics.json"
    metrics.write_text(EARLIER)
    args = [a.format(tmp=tmp_path) for a in args]
    return (args if "--metrics-json" in args else [*args, "--metrics-json", str(metrics)]), metrics


# ---- the harness (bench/run_all.py)

TINY_BATCH = 16  # a small per-GPU batch and 6 steps at n = 2 (> the scripts' 5 warm-up steps): quick runs on a busy CPU
TINY = ["--epoch-images", 12 * TINY_BATCH, "--per-gpu-batch", TINY_BATCH, "--test-batch-size", "1000"]


def harness(*args, env=None, timeout=600):
    """The harness as a user starts it. Past the timeout it gets SIGTERM, as from a user's kill: it then
    stops its runs (started in sessions of their own, a SIGKILL of the harness would leave them running)."""
    with subprocess.Popen([sys.executable, "bench/run_all.py", *map(str, args)], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment(env)) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.communicate(timeout=60)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def environment(env):
    """os.environ updated with env, less the variables env maps to None."""
    return {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}


def read_runs(out):
    import pandas as pd  # here: the gpu tests are collected where pandas is not installed
    return pd.read_csv(out / "runs.csv", keep_default_na=False, na_values=[""])


def gpu_settings(ids, per_device_batches=(32,)):
    return plan.Settings(gpus=ids, max_n=len(ids), per_device_batches=list(per_device_batches), epochs=1,
                         epoch_images=0,
                         test_batch_size=1000, seed=1, synthetic=True, data_dir="data", target_acc=0.98, timeout=60,
                         cores=16)


def has_marker(pid, marker):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"BENCH_TEST_MARKER={marker}".encode() in f.read()
    except OSError:
        return False
