"""The CUDA paths: run on a GPU machine (`python -m pytest -q -m gpu tests`); skipped where there is no GPU.

Every script of bench/family.py trains here on CUDA once, in one of two forms, all of a form's runs at once:
- one GPU each: the modes without a process group (01, 02), and 04, whose spawn starts all its processes itself;
- two ranks on GPU 0 (marker two_ranks, a step of its own in bench/gpu_check.py): every other mode, as two
  "nodes" of one process each, so that NCCL's collectives run even on a machine with a single GPU.
A new script joins the form its row's launch gives it. Besides: the step that never waits for the GPU, and the
step forms of bench/measure/step_forms.py. With the two-ranks runs start four checks, as two ranks on GPU 0 too:
the step anatomy of 03 and 08, 12 killed and resumed, and a desync named by the flight recorder. What they
measure is kept where BENCH_GPU_CHECK_WORK says, in the GPU check's archive."""
import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench import anatomy
from bench.family import LIGHTNING
from bench.measure import flight_recorder, step_forms
from helpers import MODES, ROOT, TORCHRUN, by_script, free_port, load_script, script_command, start, stop
from test_step_anatomy import B as ANATOMY_BATCH, ddp, fsdp

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
ONE_GPU_EACH_TIMEOUT_S, TWO_RANKS_TIMEOUT_S = 45, 75
WORK = os.environ.get("BENCH_GPU_CHECK_WORK")  # the GPU check's archived folder
HOOK = ROOT / "tools" / "copy_hook"  # the start-up hook of the step anatomy and of the copy checker's kill


def kept(tmp, name):
    """A folder for what a test measures: in the GPU check's archive when the check runs the test, else in tmp."""
    folder = Path(WORK) / name if WORK else tmp / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def torchrun_node(script, rank, port, *args, launcher=()):
    """One of two torchrun agents on this host, one process each: two "nodes" as 05 has them."""
    return [*TORCHRUN, *launcher, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank),
            "--master_addr", "127.0.0.1", "--master_port", str(port), script, *map(str, args)]


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
    """(exit code, stdout and stderr) of a started process; the exit code is None if it ran past the deadline."""
    try:
        stdout, stderr = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None, ""
    return process.returncode, stdout + stderr


def train_at_once(scripts, tmp, timeout, checks=None):
    """Each script's short run, all started at once: {script: its failure or None, world size, record, weights}.
    checks: {name: (folder, [(argv, env)])}, started with them: {name: its failure or None, folder, output}. A
    failed run fails its own test only. At the deadline, or when pytest is stopped (the GPU check's cut), every
    process group they started is ended."""
    started, out = {}, {}
    for name, (folder, argvs) in (checks or {}).items():
        out[name] = folder
        started[name] = (len(argvs), [start([str(a) for a in argv], env={**GPUS, **env}) for argv, env in argvs])
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
        runs[script] = SimpleNamespace(failure="; ".join(failures) or None, world_size=n, out=out[script],
                                       output="".join(err for _, err in map(ends.get, group)))
        if not failures and script not in (checks or {}):
            runs[script].record = json.loads((out[script] / "m.json").read_text())
            runs[script].weights = torch.load(out[script] / "model.pt", map_location="cpu")
    return runs


def check_run(runs, script):
    """A run trained on CUDA at the global batch, reports its GPU memory, and took 01's update."""
    mode = by_script(script)
    if mode.needs:
        pytest.importorskip(mode.needs, exc_type=ImportError)  # installed but broken: a skip
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


ANATOMY = ["03_ddp_launch.py", "08_fsdp.py"]
KILLED = "12_fsdp_big.py"  # killed once it has a snapshot, restarted by torchrun, resumed
KILL_AT = 3  # rank 0's third training forward: after the snapshots of steps 1 and 2


def anatomy_ranks(script, folder):
    """The step anatomy's profiler in two ranks on GPU 0, through its start-up hook, as bench/anatomy.py runs it."""
    port, steps = free_port(), anatomy.SKIP + 3 + 1
    hook = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HOOK), os.environ.get("PYTHONPATH")])),
            "ANATOMY_OUT": str(folder), "ANATOMY_SKIP": str(anatomy.SKIP), "ANATOMY_STEPS": "3"}
    args = ["--synthetic", "--max-steps", steps, "--log-interval", 0, "--batch-size", ANATOMY_BATCH]
    return [(torchrun_node(script, rank, port, *args), {**two_ranks_on_one_gpu(rank), **hook}) for rank in (0, 1)]


def killed_ranks(folder):
    """12 as the two-ranks run of it, with a snapshot each step; rank 0 killed at its KILL_AT-th training forward
    (tools/copy_hook); torchrun's --max-restarts 1 restarts both "nodes"."""
    port, mode = free_port(), by_script(KILLED)
    hook = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HOOK), os.environ.get("PYTHONPATH")])),
            "CHECK_COPY_OUT": str(folder / "hook"), "CHECK_COPY_KILL_AT": str(KILL_AT), "CHECK_COPY_KILL_RANK": "0",
            "CHECK_COPY_SNAPSHOT": str(folder / "s.pt")}
    (folder / "hook").mkdir(exist_ok=True)
    args = ["--synthetic", "--max-steps", 4, "--log-interval", 0, "--no-dropout", "--batch-size",
            mode.batch.loader_batch(GLOBAL_BATCH // 2, 2), "--snapshot", folder / "s.pt", "--snapshot-every", 1,
            "--save-model", folder / "model.pt"]
    return [(torchrun_node(KILLED, rank, port, *args, launcher=["--max-restarts", "1"]),
             {**two_ranks_on_one_gpu(rank), **hook}) for rank in (0, 1)]


def four_checks(tmp):
    """The checks that start with the two-ranks runs, as train_at_once takes them: {name: (folder, commands)}."""
    folders = {script: kept(tmp, f"anatomy/{script[:2]}") for script in ANATOMY}
    checks = {script: (folder, anatomy_ranks(script, folder)) for script, folder in folders.items()}
    killed = kept(tmp, "killed")
    checks["killed"] = (killed, killed_ranks(killed))
    nccl2 = kept(tmp, "nccl2")  # 03 on torch 2.15's default NCCL backend, which 2.14.1 takes when asked
    port, args = free_port(), ["--synthetic", "--max-steps", 4, "--log-interval", 0, "--no-dropout", "--batch-size",
                               GLOBAL_BATCH // 2, "--save-model", nccl2 / "model.pt"]
    checks["nccl2"] = (nccl2, [(torchrun_node("03_ddp_launch.py", rank, port, *args),
                                {**two_ranks_on_one_gpu(rank), "TORCH_DIST_USE_NCCL2": "1"}) for rank in (0, 1)])
    recorder = kept(tmp, "flight-recorder")
    checks["flight recorder"] = (recorder, [([sys.executable, "-m", "bench.measure.flight_recorder", "--out",
                                              recorder], {})])
    return checks


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every two-ranks run, and 01's beside them: the reference of their updates; and the four checks."""
    tmp = tmp_path_factory.mktemp("two-ranks")
    return train_at_once([REFERENCE, *TWO_RANKS], tmp, TWO_RANKS_TIMEOUT_S, four_checks(tmp))


@pytest.mark.two_ranks
@pytest.mark.parametrize("script", TWO_RANKS)
def test_trains_as_two_ranks_on_gpu_0(script, two_ranks):
    check_run(two_ranks, script)


def nccl_kinds(collectives):
    """A step's collectives on NCCL, by kind: record_param_comms names them as c10d does (_allgather_base, ...)."""
    kinds = {}
    for name, moved in collectives.items():
        if moved["in_bytes"] or moved["out_bytes"]:
            kind = ("all_gather" if "gather" in name else "reduce_scatter" if "scatter" in name
                    else "all_reduce" if "reduce" in name else name)
            row = kinds.setdefault(kind, dict(calls=0, in_bytes=0, out_bytes=0))
            for key in row:
                row[key] += moved[key]
    return kinds


@pytest.mark.two_ranks
@pytest.mark.parametrize("script", ANATOMY)
def test_the_step_anatomy_of_two_ranks_on_nccl_moves_the_closed_forms_bytes(script, two_ranks):
    """03: the whole gradient all-reduced. 08: gloo's all-gathers, but the gradients reduce-scattered, as NCCL
    can: each rank hands in the whole padded gradient and gets its shard back."""
    run = two_ranks[script]
    assert run.failure is None, run.failure
    ranks, _ = anatomy.analyse(str(run.out), 2)
    if script == ANATOMY[0]:
        expected = {"all_reduce": ddp()["all_reduce"]}
    else:
        gloo = fsdp(2)
        whole = gloo["all_reduce"]["in_bytes"]
        expected = {"all_gather": gloo["all_gather"],
                    "reduce_scatter": dict(calls=gloo["all_reduce"]["calls"], in_bytes=whole, out_bytes=whole // 2)}
    for rank in ranks:
        assert len(rank["steps"]) == 3
        for step in rank["steps"]:
            measured = nccl_kinds(step["collectives"])
            assert {k: {f: measured.get(k, {}).get(f) for f in v} for k, v in expected.items()} == expected, \
                (rank["rank"], step["collectives"])
            assert set(measured) == set(expected), step["collectives"]


@pytest.mark.two_ranks
def test_12_as_two_ranks_killed_on_nccl_resumes_from_its_sharded_snapshot(two_ranks):
    run, reference = two_ranks["killed"], two_ranks[REFERENCE]
    assert run.failure is None, run.failure
    assert "resuming from" in run.output, run.output[-3000:]
    records = [json.loads(p.read_text()) for p in (run.out / "hook").glob("*.json")]
    assert any(r.get("restart") == "1" for r in records), "torchrun started no second attempt"
    assert list((run.out / "hook").glob("killed-*.json")), "rank 0 was never killed"
    weights = torch.load(run.out / "model.pt", map_location="cpu")
    for key, tensor in reference.weights.items():
        torch.testing.assert_close(weights[key], tensor, rtol=1e-3, atol=1e-4, msg=f"resumed 12: {key}")


@pytest.mark.two_ranks
def test_03_as_two_ranks_on_torch_2_15s_default_nccl_backend_takes_01s_update(two_ranks):
    run, reference = two_ranks["nccl2"], two_ranks[REFERENCE]
    assert run.failure is None, run.failure
    weights = torch.load(run.out / "model.pt", map_location="cpu")
    for key, tensor in reference.weights.items():
        torch.testing.assert_close(weights[key], tensor, rtol=1e-3, atol=1e-4, msg=f"03 on NCCL2: {key}")


@pytest.mark.two_ranks
def test_the_flight_recorder_of_two_ranks_names_the_one_that_skipped_an_all_reduce_on_nccl(two_ranks):
    run = two_ranks["flight recorder"]
    assert run.failure is None, run.failure
    analysis = (run.out / "analysis.txt").read_text()
    assert flight_recorder.NAMED in analysis and "all_reduce" in analysis, analysis


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
    """Eager, compiled and the CUDA graph, 500 steps each: the step forms of the GPU check's archive."""
    path = kept(tmp_path, ".") / "step-forms.json"
    assert step_forms.main(["--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert all(result["forms"][form]["samples_per_s"] > 0 for form in step_forms.FORMS), result
    assert result["capture_check"]["matches"] and result["device"] == "cuda"


@pytest.mark.two_ranks
def test_the_all_reduce_measurement_runs_two_ranks_on_one_gpu_through_nccl(tmp_path, monkeypatch):
    """bench.measure.allreduce with more ranks than GPUs: each rank shares GPU 0, as the two-ranks runs do."""
    from bench.measure import allreduce
    monkeypatch.setitem(os.environ, "CUDA_VISIBLE_DEVICES", GPUS["CUDA_VISIBLE_DEVICES"].split(",")[0])
    path = kept(tmp_path, ".") / "allreduce-n2-one-gpu.json"
    allreduce.main(["--nprocs", "2", "--max-bytes", str(1 << 22), "--iters", "5", "--json", str(path), "--no-env"])
    result = json.loads(path.read_text())
    assert (result["backend"], result["world_size"], result["device_type"]) == ("nccl", 2, "cuda")
    assert result["gradient_row"]["busbw_gb_s"] > 0
