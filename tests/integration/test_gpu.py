"""The CUDA paths: run on a GPU machine (`python -m pytest -q -m gpu tests`); skipped where there is no GPU.

Every script of bench/family.py trains here on CUDA once, in one of two forms, all of a form's runs at once:
- one GPU each: the modes without a process group (01, 02), and 04, whose spawn starts all its processes itself;
- two ranks on GPU 0 (marker two_ranks, a step of its own in bench/gpu_check.py): every other mode, as two
  "nodes" of one process each, so that NCCL's collectives run even on a machine with a single GPU.
A new script joins the form its row's launch gives it. Besides: the step that never waits for the GPU, and the
CUDA graph of bench/measure/step_forms.py."""
import importlib.util
import json
import os
import subprocess
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from bench.family import LIGHTNING
from bench.measure import step_forms
from helpers import MODES, TORCHRUN, by_script, free_port, load_script, script_command, start, stop

pytestmark = pytest.mark.gpu


# The other tests hide the GPUs from the scripts they start; these give them back: the ones this process was
# given, else every one it sees. TF32 off (cuDNN's convolutions use it by default), so that the comparisons of
# modes below hold float32's tolerance, not TF32's.
GPUS = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES",
                                               ",".join(map(str, range(torch.cuda.device_count())))),
        "NVIDIA_TF32_OVERRIDE": "0"}


def two_ranks_on_one_gpu(rank):
    """What rank `rank` needs to share GPU 0 with the other. NCCL refuses two ranks of one host on one GPU. From
    NCCL 2.30 on (torch 2.14.1 ships 2.30.7), NCCL_MULTI_RANK_GPU_ENABLE=1 allows it. Before 2.30 it has no such
    switch: a lent H200's torch 2.11 (NCCL 2.28.9) said "Duplicate GPU detected" for all 8 modes. So each rank also
    names a host of its own (NCCL_HOSTID), which every NCCL version honours: the two "nodes" then talk over
    sockets on the loopback interface, as two real nodes would over their network."""
    return {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_HOSTID": f"two-ranks-node-{rank}", "NCCL_SOCKET_IFNAME": "lo"}


GPU_COUNT = max(1, torch.cuda.device_count())
# The global batch of every run: 64 per GPU in the one-GPU-each form, which two ranks split evenly too.
GLOBAL_BATCH = 64 * GPU_COUNT
ON_CUDA = SimpleNamespace(cpu=False, kind="gpu")  # what a launch's flags ask of the harness's settings
# The wait for each form's runs, all of them together. One GPU each: 2.5 start-ups of 18 s, the slowest measured
# on an H200. Two ranks: 19 to 23 processes on 16 cores. With pytest's own start-up, both end inside their steps'
# bounds in bench/gpu_check.py (68 s, and 81-95 s).
ONE_GPU_EACH_TIMEOUT_S, TWO_RANKS_TIMEOUT_S = 45, 65


def torchrun_node(script, rank, port, *args):
    """One of two torchrun agents on this host, one process each: two "nodes" as 05 has them."""
    return [*TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank), "--master_addr",
            "127.0.0.1", "--master_port", str(port), script, *map(str, args)]


def two_ranks_command(mode, rank, port):
    """Rank `rank` of a mode run as two ranks on GPU 0, each a "node" of one process; None for a mode that cannot
    be started so (one process: 01, 02; 04's spawn starts all its processes itself)."""
    if mode.launch.nodes > 1:  # 05 says which node it is with flags of its own
        return script_command(mode.script, "-n", 2, "-g", 1, "--nr", rank, "--master-port", port)
    if mode.launch.torchrun:
        return torchrun_node(mode.script, rank, port)
    if mode.launch is LIGHTNING:  # Lightning reads its node from torchrun's environment
        return torchrun_node(mode.script, rank, port, "--devices", 1, "--num-nodes", 2)
    return None


# 11 too, as a 1 x 2 mesh (dp = 1): a sweep runs it at n = 4, 8... only, but its CUDA paths are the same.
TWO_RANKS = [m.script for m in MODES.values()
             if two_ranks_command(m, 0, 0) and (m.runs_with(2, False) or m.batch.shared_by == 2)]
ONE_GPU_EACH = [m.script for m in MODES.values() if m.script not in TWO_RANKS]
REFERENCE = "01_single_gpu.py"  # every run's weights are compared with its


def commands(mode, port):
    """(world size, commands) of a mode's run in its form. One GPU each: 01 on one, 02 driving them all, 04 spawning
    a process for each."""
    if mode.script in TWO_RANKS:
        return 2, [two_ranks_command(mode, rank, port) for rank in (0, 1)]
    n = GPU_COUNT if mode.runs_with(GPU_COUNT, False) else 1
    return n, [script_command(mode.script, *mode.launch.flags(n, ON_CUDA), nprocs=n)]


def finish(process, deadline):
    """(exit code, stderr) of a started process; the exit code is None if it still ran at the deadline."""
    try:
        _, stderr = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None, ""
    return process.returncode, stderr


def train_at_once(scripts, tmp, timeout):
    """Each script's short run, all started at once: {script: its failure or None, world size, record, weights}.
    A failed run fails its own test only. At the deadline, or when pytest is stopped (the GPU check's cut), every
    process group they started is ended."""
    started, out = {}, {}
    for script in scripts:
        mode = by_script(script)
        if mode.needs and importlib.util.find_spec(mode.needs) is None:
            continue  # its test skips, saying what is missing
        out[script] = tmp / script
        out[script].mkdir()
        n, argvs = commands(mode, free_port())
        per_device = GLOBAL_BATCH if mode.batch.shared else GLOBAL_BATCH * mode.batch.shared_by // n  # 11: a pair's
        args = ["--synthetic", "--max-steps", 4, "--log-interval", 0, "--no-dropout", "--batch-size",
                mode.batch.loader_batch(per_device, n), "--metrics-json", out[script] / "m.json",
                "--save-model", out[script] / "model.pt"] + ["--snapshot", out[script] / "snapshot.pt"] * mode.snapshot
        started[script] = (n, [start(argv + [str(a) for a in args],
                                     env={**GPUS, **(two_ranks_on_one_gpu(rank) if script in TWO_RANKS else {})})
                               for rank, argv in enumerate(argvs)])
    processes = [p for _, group in started.values() for p in group]
    began, deadline = time.monotonic(), time.monotonic() + timeout
    pool = ThreadPoolExecutor(len(processes))  # a reader each: no run may stall on a full pipe
    try:
        ends = dict(zip(processes, pool.map(lambda p: finish(p, deadline), processes)))
    finally:
        stop(processes)
        pool.shutdown()
    print(f"{len(started)} runs, {len(processes)} processes at once: {time.monotonic() - began:.0f} s")
    runs = {}
    for script, (n, group) in started.items():
        failures = [f"still running after {timeout} s" if code is None else f"exit code {code}: {err[-3000:]}"
                    for code, err in map(ends.get, group) if code != 0]
        runs[script] = SimpleNamespace(failure="; ".join(failures) or None, world_size=n, out=out[script])
        if not failures:
            runs[script].record = json.loads((out[script] / "m.json").read_text())
            runs[script].weights = torch.load(out[script] / "model.pt", map_location="cpu")
    return runs


def check_run(runs, script):
    """A run trained on CUDA at the global batch, reports its GPU memory, and took 01's update."""
    mode = by_script(script)
    if mode.needs:
        pytest.importorskip(mode.needs)
    run, reference = runs[script], runs[REFERENCE]
    assert run.failure is None, run.failure
    record = run.record
    assert (record["device_type"], record["world_size"]) == ("cuda", run.world_size)
    assert 0 < record["peak_memory_bytes"] < torch.cuda.get_device_properties(0).total_memory
    assert record["global_batch"] == GLOBAL_BATCH and record["samples_per_s"] > 0
    assert record["backend"] == ("nccl" if mode.collective else None)
    if mode.snapshot:  # 06's snapshot gathers every rank's RNG state: an object collective, on each rank's GPU
        assert (run.out / "snapshot.pt").exists()
    # Same global batch, same update, on the GPU too. cuDNN's convolution backward is not deterministic (atomic
    # adds), so two runs of the same script differ slightly and the differences grow with every step: compare
    # after a few steps only (after 30, 02 was already outside this tolerance on an H200).
    assert reference.failure is None, f"01, the reference: {reference.failure}"
    for key, tensor in reference.weights.items():
        torch.testing.assert_close(run.weights[key], tensor, rtol=1e-3, atol=1e-4, msg=f"{script}: {key}")


@pytest.fixture(scope="module")
def one_gpu_each(tmp_path_factory):
    return train_at_once(ONE_GPU_EACH, tmp_path_factory.mktemp("one-gpu-each"), ONE_GPU_EACH_TIMEOUT_S)


@pytest.mark.parametrize("script", ONE_GPU_EACH)
def test_trains_on_cuda_one_gpu_each(script, one_gpu_each):
    check_run(one_gpu_each, script)
    record = one_gpu_each[script].record
    if by_script(script).batch.one_loader:  # DataParallel: one process, each GPU's own peak
        per_gpu = record["epochs_detail"][0]["peak_memory_per_device"]
        assert len(per_gpu) == GPU_COUNT and record["peak_memory_bytes"] == max(per_gpu)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every two-ranks run, and 01's beside them: the reference of their updates."""
    return train_at_once([REFERENCE, *TWO_RANKS], tmp_path_factory.mktemp("two-ranks"), TWO_RANKS_TIMEOUT_S)


@pytest.mark.two_ranks
@pytest.mark.parametrize("script", TWO_RANKS)
def test_trains_as_two_ranks_on_gpu_0(script, two_ranks):
    check_run(two_ranks, script)


def test_a_training_step_never_waits_for_the_gpu(quick_mnist_dir):
    """Synchronisations per epoch, counted by CUDA's sync debug mode: as many for 12 steps as for 4."""
    single = load_script("01_single_gpu.py")
    args = single.parse_args(["--data-dir", str(quick_mnist_dir), "--log-interval", "0"])
    world = single.setup(args)
    net = single.Net().to(world.device)
    optimizer = torch.optim.Adadelta(net.parameters())
    epochs = []

    def synchronisations(steps):
        args.max_steps = steps
        training, _ = single.load_data(args, 0, 1, world.device)
        batches = single.timed(training(len(epochs) + 1), world, epochs)  # measured too
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                single.train_epoch(net, batches, optimizer, args, world, epoch=len(epochs) + 1)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message) for w in caught)

    synchronisations(8)  # the first epoch also pays for start-up, and its warm-up steps wait on purpose
    assert synchronisations(12) == synchronisations(4)


# ---- bench/measure/step_forms.py on CUDA: the whole step as one CUDA graph (the CPU: tests/unit/test_step_forms.py)

def test_the_captured_step_updates_as_the_eager_one_and_follows_the_scheduler():
    batches = step_forms.synthetic_batches(torch.device("cuda"))
    check = step_forms.check_capture(load_script(), batches)
    assert check["matches"], check
    assert check["before"]["lr"] == 1.0 and check["after"]["lr"] == pytest.approx(0.7)  # StepLR reached the graph


def test_a_learning_rate_baked_into_the_graph_fails_the_check(monkeypatch):
    """The check's power: with lr a float, StepLR changes the eager update only, and the check says so."""
    def with_a_float_lr(model, lr):
        return torch.optim.Adadelta(model.parameters(), lr=lr, capturable=True)
    monkeypatch.setattr(step_forms, "capturable_adadelta", with_a_float_lr)
    batches = step_forms.synthetic_batches(torch.device("cuda"))
    check = step_forms.check_capture(load_script(), batches)
    assert check["before"]["within_tolerance"] and not check["after"]["within_tolerance"], check
    assert check["after"]["largest_difference"] > 100 * step_forms.ATOL and not check["matches"]


def test_each_step_form_is_timed_on_cuda(tmp_path):
    """Eager and the CUDA graph (the GPU check's step forms times compile too)."""
    assert step_forms.main(["--forms", "eager,graph", "--steps", "20", "--json", str(tmp_path / "f.json")]) == 0
    result = json.loads((tmp_path / "f.json").read_text())
    assert all(result["forms"][form]["samples_per_s"] > 0 for form in ("eager", "graph")), result
    assert result["capture_check"]["matches"] and result["device"] == "cuda"
