"""What the README tells a learner about DDP itself, and the common errors it lists, reproduced on the CPU.

Two DDP processes (gloo) run in-process through torch.multiprocessing for the claims about DDP (no_sync, the
buffers, the `module.` prefix, the wrong-device ValueError, TORCH_DISTRIBUTED_DEBUG); the errors a user meets
at the command line are reproduced by starting a script as the user would, with a timeout. The README's
errors that need a GPU (everything on GPU 0, DataParallel's memory on GPU 0, NCCL's own errors) cite torch's
source instead and are not claimed here. What the README says of PyTorch that one process shows:
tests/unit/test_readme_claims_in_process.py.
"""
import inspect
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import CPU_ONLY, NO_NETWORK, ROOT, TORCHRUN, free_port, launcher_env, run

WORLD_SIZE = 2
MICRO_BATCHES = 4  # gradient accumulation: 4 micro-batches, one optimizer step


def counting_hook(state, bucket):
    """A DDP communication hook that counts the all-reduces DDP starts (one per bucket; this model has one)."""
    state["all_reduces"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def accumulate(rank, forward_inside):
    """All-reduces counted after each of MICRO_BATCHES micro-batches, the first k-1 under no_sync."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 2))
    state = {"all_reduces": 0}
    model.register_comm_hook(state, counting_hook)
    counts = []
    for i in range(MICRO_BATCHES):
        x = torch.randn(4, 8) + rank
        last = i == MICRO_BATCHES - 1
        if last:
            model(x).sum().backward()
        elif forward_inside:
            with model.no_sync():
                model(x).sum().backward()
        else:
            output = model(x)  # the forward outside no_sync, as the old README had it
            with model.no_sync():
                output.sum().backward()
        counts.append(state["all_reduces"])
    return counts, model.module.weight.grad.clone()


# broadcast_buffers until torch 2.1x, forward_sync_buffers after (2.10 has only the first, 2.14 both, the first
# deprecated): the test takes the one this torch names.
SYNC_BUFFERS = next(name for name in ("forward_sync_buffers", "broadcast_buffers")
                    if name in inspect.signature(DDP).parameters)


def buffers_before_forward(rank, sync):
    """Rank 1 spoils its BatchNorm mean after DDP is built; what it holds after one training forward."""
    torch.manual_seed(0)
    options = {} if sync is None else {SYNC_BUFFERS: sync}
    model = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), **options)
    if rank == 1:
        with torch.no_grad():
            model.module[1].running_mean.fill_(100.0)
    model(torch.randn(16, 4))
    return model.module[1].running_mean.clone()


def statistics_after_training(rank):
    """Each rank's BatchNorm running mean after three steps on data of its own, then after 03's broadcast."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(16, 4) + 3 * rank).sum().backward()
        optimizer.step()
    after_training = net[1].running_mean.clone()
    for buffer in net.buffers():  # what 03's evaluate() does first
        dist.broadcast(buffer, 0)
    return after_training, net[1].running_mean.clone()


def evaluate_on_rank_0_alone(rank):
    """After a training step, rank 0 alone evaluates the DDP model of a BatchNorm net, as a user might under
    `if rank == 0:`, on a group that gives up after 3 s: what its forward raised, and how long it waited."""
    torch.manual_seed(0)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
    model = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), process_group=group)
    model(torch.randn(16, 4)).sum().backward()  # both ranks: one training step's forward and backward
    if rank != 0:
        time.sleep(6)  # rank 1 goes on to other work; it never calls that forward
        return None
    start = time.monotonic()
    try:
        with torch.no_grad():
            model.eval()(torch.randn(16, 4))
    except RuntimeError as e:
        return str(e).splitlines()[0], time.monotonic() - start
    return "", time.monotonic() - start


def wrong_device(rank):
    """The posts' order: DDP(model, device_ids=[local_rank]) while the model is still on the CPU."""
    try:
        DDP(nn.Linear(2, 2), device_ids=[rank])
    except ValueError as e:
        return str(e)
    return None


def state_dict_prefix(rank):
    """What a DDP model's state dict holds, and what loading it into the plain model says."""
    model = DDP(nn.Linear(2, 2))
    saved = model.state_dict()
    try:
        nn.Linear(2, 2).load_state_dict(saved)
        error = None
    except RuntimeError as e:
        error = str(e)
    return sorted(saved), error, sorted(model.module.state_dict())


def mismatched_collectives(rank):
    """Rank 0 all-reduces while rank 1 broadcasts, with TORCH_DISTRIBUTED_DEBUG=DETAIL read as torch reads it
    on import (set_debug_level_from_env), for a new group: what a job started with the variable set gets."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    group = dist.new_group(backend="gloo")
    tensor = torch.ones(3)
    try:
        dist.all_reduce(tensor, group=group) if rank == 0 else dist.broadcast(tensor, 0, group=group)
    except RuntimeError as e:
        return str(e)
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
    return ""


EXPERIMENTS = {"backward inside": lambda rank: accumulate(rank, forward_inside=False),
               "forward and backward inside": lambda rank: accumulate(rank, forward_inside=True),
               "buffers synced": lambda rank: buffers_before_forward(rank, None),
               "buffers not synced": lambda rank: buffers_before_forward(rank, False),
               "statistics": statistics_after_training,
               "wrong device": wrong_device,
               "rank 0 alone": evaluate_on_rank_0_alone,
               "prefix": state_dict_prefix,
               "mismatch": mismatched_collectives}  # last: it leaves a group with a failed collective


def worker(rank, port, out, names):
    """One of two gloo processes: joins the group, runs each experiment, saves what it found."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    found = {}
    for name in names:
        found[name] = EXPERIMENTS[name](rank)
    torch.save(found, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def run_on_two_ranks(tmp_path, names):
    mp.start_processes(worker, args=(free_port(), str(tmp_path), names), nprocs=WORLD_SIZE, start_method="spawn")
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every experiment on two DDP processes, once for the module: [rank 0's findings, rank 1's]."""
    return run_on_two_ranks(tmp_path_factory.mktemp("ranks"), list(EXPERIMENTS))


def test_no_sync_saves_the_all_reduce_only_with_the_forward_inside(ranks):
    backward_only = [found["backward inside"] for found in ranks]
    both_inside = [found["forward and backward inside"] for found in ranks]
    assert backward_only[0][0] == [1, 2, 3, 4]  # one all-reduce per micro-batch: no_sync saved nothing
    assert both_inside[0][0] == [0, 0, 0, 1]  # one all-reduce for the k micro-batches
    torch.testing.assert_close(both_inside[0][1], both_inside[1][1])  # the ranks' gradients agree


def test_ddp_broadcasts_rank_0s_buffers_before_every_forward(ranks):
    synced, unsynced = ranks[1]["buffers synced"], ranks[1]["buffers not synced"]
    assert synced.abs().max() < 10  # rank 0's zeros, then this batch's mean: rank 1's 100 is gone
    assert unsynced.min() > 80  # without it: 0.9 x 100 + 0.1 x this batch's mean


def test_ranks_running_statistics_differ_after_training_until_rank_0s_are_broadcast(ranks):
    (trained_0, broadcast_0), (trained_1, broadcast_1) = [found["statistics"] for found in ranks]
    assert (trained_0 - trained_1).abs().max() > 0.1  # each rank's last batch is in its own statistics
    torch.testing.assert_close(broadcast_0, broadcast_1, rtol=0, atol=0)


def test_a_ddp_forward_on_rank_0_alone_waits_for_the_other_ranks_until_the_timeout(ranks):
    """The README's error row: rank 0 alone evaluates a DDP model and hangs, here on a 3 s timeout."""
    message, waited = ranks[0]["rank 0 alone"]
    assert message and waited >= 2.5, (message, waited)  # the forward's broadcast of the buffers waited for rank 1


def test_wrapping_a_model_still_on_the_cpu_with_device_ids_raises_the_posts_value_error(ranks):
    message = ranks[0]["wrong device"]
    assert message and message.startswith("DistributedDataParallel device_ids and output_device arguments only "
                                           "work with single-device/multiple-device GPU modules or CPU modules")


def test_a_ddp_state_dict_has_module_prefixes_and_the_fix_loads(ranks):
    keys, error, plain_keys = ranks[0]["prefix"]
    assert keys == ["module.bias", "module.weight"] and plain_keys == ["bias", "weight"]
    assert 'Missing key(s) in state_dict: "weight", "bias"' in error
    assert 'Unexpected key(s) in state_dict: "module.weight", "module.bias"' in error
    state = {f"module.{k}": v for k, v in nn.Linear(2, 2).state_dict().items()}  # a file saved with them
    consume_prefix_in_state_dict_if_present(state, "module.")  # the fix for it; new files: model.module
    nn.Linear(2, 2).load_state_dict(state)


def test_torch_distributed_debug_detail_names_the_mismatched_collectives(ranks):
    said = ranks[0]["mismatch"] + ranks[1]["mismatch"]
    assert "Detected mismatch between collectives on ranks" in said, said
    assert "ALLREDUCE" in said and "BROADCAST" in said, said


def test_a_taken_master_port_fails_with_address_already_in_use():
    """torchrun without --standalone, on the default kind of fixed port, when another job holds it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run([*TORCHRUN, "--nproc_per_node", "1", "--master-port", str(port), "03_ddp_launch.py",
                      "--synthetic", "--max-steps", "1"], timeout=120, check=False)
    assert result.returncode != 0
    assert f"port: {port}" in result.stderr and "EADDRINUSE, message: address already in use" in result.stderr


def test_a_worker_error_is_one_line_above_torchruns_own_traceback():
    result = run([*TORCHRUN, "--standalone", "--nproc_per_node", "1", "03_ddp_launch.py", "--epochs", "0"],
                 timeout=120, check=False)
    lines = result.stderr.splitlines()
    assert result.returncode == 1 and lines[0] == "error: argument --epochs: must be in [1, inf), got 0", lines[:3]
    assert "ChildFailedError" in result.stderr and "Root Cause (first observed failure)" in result.stderr
    assert lines.index("Traceback (most recent call last):") > 0  # the launcher's, after the worker's line


def rank_0_alone(**env):
    """Rank 0 of two started by hand as torchrun would start it; rank 1 never starts. Returned once rank 0's
    store is up: it is in init_process_group, waiting for rank 1."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **CPU_ONLY, **NO_NETWORK, **launcher_env(world_size=2), **env}
    waiting = subprocess.Popen([sys.executable, "03_ddp_launch.py", "--synthetic", "--max-steps", "1"], cwd=ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not listening(int(env["MASTER_PORT"])):
        if waiting.poll() is not None or time.monotonic() > deadline:
            waiting.kill()
            pytest.fail(f"rank 0 did not wait for rank 1: {waiting.communicate()}")
        time.sleep(0.2)
    return waiting


def test_a_rank_that_never_comes_leaves_the_others_waiting_silently():
    waiting = rank_0_alone()
    try:
        time.sleep(2)
        assert waiting.poll() is None  # still waiting, and it would until the timeout (30 minutes with gloo)
    finally:
        waiting.kill()
        out, err = waiting.communicate()
    assert out == "" and "Traceback" not in err


def test_a_stuck_rank_with_the_fault_handler_prints_where_it_waits_when_sent_sigabrt():
    """The README's row: PYTHONFAULTHANDLER=1, then kill -ABRT PID: the Python stack, 03's own line in it."""
    waiting = rank_0_alone(PYTHONFAULTHANDLER="1")
    try:
        time.sleep(1)
        waiting.send_signal(signal.SIGABRT)
        _, err = waiting.communicate(timeout=30)
    finally:
        waiting.kill()
    assert "Fatal Python error: Aborted" in err and "in init_process_group" in err, err[-3000:]
    assert re.search(r'03_ddp_launch\.py", line \d+ in setup', err), err[-3000:]


def test_a_torchrun_nnodes_miscount_waits_for_the_join_timeout():
    """--nnodes 2 and one agent: torchrun's rendezvous waits its join timeout, 600 s unless --rdzv-conf says."""
    assert RendezvousTimeout().join == timedelta(seconds=600)  # the README's "600 s by default"
    started = time.monotonic()
    result = run([*TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                  f"127.0.0.1:{free_port()}", "--rdzv-conf", "join_timeout=5", "03_ddp_launch.py", "--synthetic",
                  "--max-steps", "1"], timeout=120, check=False)
    assert result.returncode != 0 and "RendezvousTimeoutError" in result.stderr, result.stderr[-3000:]
    assert time.monotonic() - started < 60 and result.stdout == ""  # no worker started


def test_torchruns_log_dir_gives_each_rank_its_own_log_and_tee_prefixes_the_screens_lines(tmp_path):
    shown = run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "--log-dir", tmp_path, "--redirects", "3",
                 "--tee", "3", "03_ddp_launch.py", "--synthetic", "--max-steps", "2", "--log-interval", "0"],
                timeout=180).stdout
    assert re.search(r"^\[default0\]:03_ddp_launch\.py: \d+ samples/s", shown, re.M), shown  # the screen too
    logs = {path.parent.name: path.read_text() for path in tmp_path.glob("*/attempt_0/*/stdout.log")}
    assert sorted(logs) == ["0", "1"] and "samples/s, world size 2" in logs["0"], logs  # rank 0 prints
    errors = sorted(path.parent.name for path in tmp_path.glob("*/attempt_0/*/stderr.log"))
    assert errors == ["0", "1"], errors


def listening(port):
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


