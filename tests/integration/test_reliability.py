"""Reliability: a killed worker is restarted and resumes exactly, a save cannot be torn, failures end quickly
and clearly (a bug with its traceback), ranks that see different snapshots stop, jobs on one host never collide
on a port, and 05 runs between two network namespaces.

Every wait has a deadline well under the job's own timeouts and fails naming what did not happen: a broken
guarantee fails a test within seconds, not by hanging into pytest's or CI's limit."""
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import (AGAIN, EXIT_ABORT, MODES, ROOT, TORCHRUN, busy_note, by_script, error_lines, free_port,
                     launcher_env, load_script, on_pythonpath, processes_for, run, run_two_nodes, script_command,
                     slack, start, stop)

# One thread per process everywhere: two "nodes" on one host would otherwise take two each, and a different
# number of threads sums in a different order (equal weights, not bitwise equal). 20 steps an epoch: snapshots
# at steps 8 and 16 and at the epoch's end.
TRAIN = ["--epochs", 2, "--max-steps", 20, "--batch-size", 32, "--log-interval", 0, "--snapshot-every", 8,
         "--threads", 1]
SCRIPT = ROOT / "06_fault_tolerant.py"
RESTARTED = "will restart worker group"  # torchrun's agent, once per restart it spends (LOGLEVEL=INFO)


def children(pid):
    """Process ids whose parent is pid (what torchrun and mp.spawn start), the last started last: by start time,
    not by id, which wraps around at the kernel's pid_max on a machine that has run many processes."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the name: state, parent... start time
            kids += [(int(fields[19]), int(stat.parent.name))] if int(fields[1]) == pid else []
        except (OSError, IndexError, ValueError):
            pass  # the process ended while we looked
    return [kid for _, kid in sorted(kids)]


def wait_for(condition, timeout, what, job=None, interval=0.005):
    """Until condition() holds; fails naming what, after timeout seconds or as soon as job has ended."""
    deadline = time.monotonic() + timeout
    while not condition():
        if job is not None and job.process.poll() is not None:
            pytest.fail(f"the job ended (exit {job.process.returncode}) before {what}:\n{job.tail()}")
        if time.monotonic() > deadline:
            pytest.fail(f"{timeout} s passed before {what} ({busy_note()})" + (f":\n{job.tail()}" if job else ""))
        time.sleep(interval)


class Job:
    """A command in the background, its output read as it comes (a blocking readline has no deadline)."""

    def __init__(self, command, env=None):
        self.process = start([str(a) for a in command], env=env)
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=lambda s=stream, lines=lines: lines.extend(s), daemon=True)
                        for stream, lines in ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def tail(self):
        return "".join(self.err)[-3000:]

    def wait_for_line(self, prefix, timeout):
        wait_for(lambda: any(line.startswith(prefix) for line in list(self.out)), timeout,
                 f"a line starting {prefix!r}", job=self)

    def finish(self, timeout, what):
        """(exit status, stdout, stderr) once it ends; fails if it still runs after timeout seconds."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{what}: still running {timeout} s later ({busy_note()}):\n{self.tail()}")
        for reader in self.readers:
            reader.join(timeout=10)
        return self.process.returncode, "".join(self.out), "".join(self.err)

    def kill(self):
        """The process and those it started (a killed torchrun leaves its workers running): its process group."""
        stop([self.process])
        self.process.wait()


def torchrun_06(out, quick_mnist_dir, *extra, launcher=()):
    args = ["--data-dir", quick_mnist_dir, "--snapshot", out / "snapshot.pt", "--save-model", out / "model.pt",
            "--metrics-json", out / "metrics.json", *TRAIN, *extra]
    out.mkdir(exist_ok=True)
    return script_command("06_fault_tolerant.py", *args, nprocs=2, launcher=launcher)


def by_hand(world_size, *args):
    """world_size processes of 06, started with the variables torchrun gives its workers but no launcher: each
    one's own output, and no launcher that stops the others first."""
    env = launcher_env(world_size)
    return [Job([sys.executable, SCRIPT, *args], env={**env, "RANK": str(rank)}) for rank in range(world_size)]


def snapshot_position(path):
    state = torch.load(path)
    return state["epoch"], state["step"]


@pytest.fixture(scope="module")
def uninterrupted(quick_mnist_dir, tmp_path_factory):
    """Two epochs with dropout on: every rank's own masks must resume too."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    run(torchrun_06(out, quick_mnist_dir))
    return SimpleNamespace(record=json.loads((out / "metrics.json").read_text()),
                           weights=torch.load(out / "model.pt"), snapshot=out / "snapshot.pt")


def assert_same_training(out, uninterrupted):
    """Bitwise the same weights (the schedule and every rank's RNG resumed too), the same test results, and the
    resumed epoch's training loss that of the whole epoch (each rank's sum so far is in the snapshot)."""
    record, weights = json.loads((out / "metrics.json").read_text()), torch.load(out / "model.pt")
    assert all(torch.equal(weights[k], uninterrupted.weights[k]) for k in uninterrupted.weights), "weights differ"
    keys, last = ("epoch", "train_loss", "test_loss", "test_accuracy"), uninterrupted.record["epochs_detail"][-1]
    assert {k: record["epochs_detail"][-1][k] for k in keys} == {k: last[k] for k in keys}


def test_a_killed_worker_is_restarted_and_training_resumes_exactly(uninterrupted, quick_mnist_dir, tmp_path):
    out = tmp_path / "killed"
    job = Job(torchrun_06(out, quick_mnist_dir, "--log-interval", 1, launcher=["--max-restarts", "3"]),
              env={"LOGLEVEL": "INFO"})
    try:  # in epoch 2, one step after its first snapshot: the schedule and the RNG must resume as well
        job.wait_for_line("epoch 2 step 9 ", timeout=120)
        os.kill(children(job.process.pid)[-1], signal.SIGKILL)
        returncode, stdout, stderr = job.finish(120, "the restarted job")
    finally:
        job.kill()
    assert returncode == 0, stderr
    assert stdout.count("resuming from") == 1 and "epoch 2, step 8" in stdout, stdout
    assert stderr.count(RESTARTED) == 1, f"one kill, {stderr.count(RESTARTED)} restarts:\n{stderr}"
    assert_same_training(out, uninterrupted)


def test_the_last_snapshot_follows_the_outputs_and_a_finished_job_has_nothing_to_do(uninterrupted,
                                                                                     quick_mnist_dir, tmp_path):
    out = tmp_path / "resumed"
    out.mkdir()
    (out / "metrics.json.tmp").mkdir()  # writing the record fails, after the training and the model
    failed = run(torchrun_06(out, quick_mnist_dir, "--epochs", 1), check=False)
    assert failed.returncode != 0 and "IsADirectoryError" in failed.stderr, failed.stderr
    assert (out / "model.pt").exists() and not (out / "metrics.json").exists()
    assert snapshot_position(out / "snapshot.pt") == (1, 16), "the last snapshot was taken before the outputs"
    saved = "world size 2, --batch-size 32, --seed 1, 20 steps an epoch"
    files = lambda: {path: path.read_bytes() for path in out.iterdir() if path.is_file()}  # noqa: E731
    before = files()
    # Step 16 of 20 resumed at 10 steps an epoch would start past the epoch's end: the same batch size and
    # world size, yet another layout (accepted, it trained no step and reported a NaN loss at 0 samples/s).
    fewer_steps = run(torchrun_06(out, quick_mnist_dir, "--max-steps", 10), check=False)
    assert fewer_steps.returncode != 0 and (  # each rank says it: their lines may interleave
        f"error: snapshot {out / 'snapshot.pt'} is from {saved}, not {saved.replace('20 steps', '10 steps')}: "
        "match it or move it") in fewer_steps.stderr, fewer_steps.stderr
    assert f'File "{SCRIPT}"' not in fewer_steps.stderr, fewer_steps.stderr  # no worker's traceback (torchrun has one)
    assert files() == before, "a refused resume changed the outputs or the snapshot"
    (out / "metrics.json.tmp").rmdir()
    assert "epoch 1, step 16" in run(torchrun_06(out, quick_mnist_dir)).stdout  # where run 1 stopped
    assert_same_training(out, uninterrupted)
    assert snapshot_position(out / "snapshot.pt") == (3, 0)
    assert not list(out.glob("*.tmp")), "a save left its temporary file"
    before = {path: path.read_bytes() for path in out.iterdir()}
    result = run(torchrun_06(out, quick_mnist_dir))
    assert "nothing to do" in result.stderr
    one = by_hand(1, "--data-dir", quick_mnist_dir, "--snapshot", out / "snapshot.pt", *TRAIN)[0]
    returncode, _, stderr = one.finish(60, "one process given a snapshot of two")
    assert returncode == 1 and error_lines(stderr) == [
        f"error: snapshot {out / 'snapshot.pt'} is from {saved}, not {saved.replace('size 2', 'size 1')}: "
        "match it or move it"], stderr
    assert "Traceback" not in stderr
    other_batch = run(torchrun_06(out, quick_mnist_dir, "--batch-size", 16), check=False)  # same step, other images
    assert other_batch.returncode != 0 and (  # each rank says it: their lines may interleave
        f"error: snapshot {out / 'snapshot.pt'} is from {saved}, not {saved.replace('32', '16')}: "
        "match it or move it") in other_batch.stderr, other_batch.stderr
    assert {path: path.read_bytes() for path in out.iterdir()} == before


def test_a_save_renames_a_whole_file_and_a_kill_during_it_leaves_the_last_one_loadable(quick_mnist_dir,
                                                                                      tmp_path):
    snapshot, kept = tmp_path / "snapshot.pt", tmp_path / "kept.pt"
    job = by_hand(1, "--data-dir", quick_mnist_dir, "--snapshot", snapshot, "--snapshot-every", 1,
                  "--log-interval", 0, "--threads", 1)[0]  # the process that saves, no launcher around it
    try:
        wait_for(snapshot.exists, 60, "the first snapshot", job)
        os.link(snapshot, kept)  # a second name for this file: a rename over the path leaves it be
        content, first = kept.read_bytes(), os.stat(kept)
        wait_for(lambda: (os.stat(snapshot).st_ino, os.stat(snapshot).st_mtime_ns) != (
            first.st_ino, first.st_mtime_ns), 30, "a later snapshot", job)
        assert os.stat(snapshot).st_ino != first.st_ino, "the later snapshot was written into the earlier file"
        assert kept.read_bytes() == content, "a save changed a snapshot already written"
        wait_for(Path(f"{snapshot}.tmp").exists, 30, "a save under way", job, interval=0.0005)
        job.process.send_signal(signal.SIGKILL)
        job.finish(30, "06 after a SIGKILL")
    finally:
        job.kill()
    assert snapshot_position(snapshot) >= (1, 2)  # the last whole one


def test_a_bug_keeps_its_traceback(quick_mnist_dir, tmp_path):
    """06 puts what it can explain (a lost peer, a timeout) in one line: a shape error is none of those."""
    broken = tmp_path / "06_fault_tolerant.py"
    broken.write_text(SCRIPT.read_text().replace("nn.Linear(9216, 128)", "nn.Linear(9000, 128)"))
    result = run([sys.executable, str(broken), "--data-dir", str(quick_mnist_dir), "--max-steps", "1"], timeout=60,
                 check=False, env=launcher_env(1))
    assert result.returncode == 1 and "Traceback (most recent call last)" in result.stderr, result.stderr
    assert "RuntimeError: mat1 and mat2 shapes" in result.stderr.strip().splitlines()[-1], result.stderr  # [rank0]: ...
    assert not error_lines(result.stderr), result.stderr


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_lost_peer_ends_the_other_rank_within_the_timeout_in_one_line(how, quick_mnist_dir):
    """gloo: a killed peer closes its connections, a stopped one lets --timeout pass; each a line, no traceback."""
    timeout = {"killed": 30, "stopped": 8}[how]  # stopped: long enough for both to start on a busy machine
    ranks = by_hand(2, "--data-dir", quick_mnist_dir, "--epochs", 5, "--log-interval", 1, "--timeout", timeout,
                    "--threads", 1)
    try:
        ranks[0].wait_for_line("epoch 1 step 2 ", timeout=60)
        os.kill(ranks[1].process.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        lost = time.monotonic()
        returncode, _, stderr = ranks[0].finish(30, f"rank 0, its peer {how}")
        took = time.monotonic() - lost
    finally:
        for job in ranks:
            job.kill()
    said = {"killed": r"Connection (closed|reset) by peer", "stopped": "Timed out waiting 8000ms"}[how]
    errors = error_lines(stderr)
    assert returncode == 1 and len(errors) == 1 and "Traceback" not in stderr, stderr
    assert errors[0].startswith("error: rank 0 stopped (a peer lost, or --timeout passed): "), errors[0]
    assert re.search(said, errors[0]), errors[0]  # gloo's words, after its source file and line
    assert took < {"killed": 5, "stopped": timeout + 5}[how], f"{took:.1f} s after its peer was {how} ({busy_note()})"


def test_timeout_bounds_the_wait_for_torchruns_store(quick_mnist_dir):
    """A worker told to use its agent's store, where nothing answers: one line once --timeout has passed
    (the TCPStore client tries twice)."""
    env = {**launcher_env(2), "TORCHELASTIC_USE_AGENT_STORE": "True"}  # launcher_env's port: no one listens
    job = Job([sys.executable, SCRIPT, "--data-dir", quick_mnist_dir, "--timeout", 2], env=env)
    try:
        returncode, _, stderr = job.finish(40, "06 waiting for a store that is not there, with --timeout 2")
    finally:
        job.kill()
    errors = error_lines(stderr)
    assert returncode == 1 and len(errors) == 1 and "Traceback" not in stderr, stderr
    assert errors[0].startswith("error: rank 0 could not join the others") and "timed out" in errors[0]


def test_a_corrupt_snapshot_stops_every_rank_in_one_line(quick_mnist_dir, tmp_path):
    snapshot = tmp_path / "snapshot.pt"
    snapshot.write_bytes(b"not a snapshot")
    ranks = by_hand(2, "--data-dir", quick_mnist_dir, "--snapshot", snapshot, "--timeout", 20)
    try:
        results = [job.finish(60, f"rank {rank}, the snapshot corrupt") for rank, job in enumerate(ranks)]
    finally:
        for job in ranks:
            job.kill()
    for returncode, _, stderr in results:
        errors = error_lines(stderr)
        assert returncode == 1 and len(errors) == 1 and "Traceback" not in stderr, stderr
        assert errors[0].startswith(f"error: snapshot {snapshot} could not be loaded ("), errors
    assert snapshot.read_bytes() == b"not a snapshot"


def two_agents(tmp_path, quick_mnist_dir, snapshots, *launcher, extra=(), env=None):
    """Two torchrun agents on this host meeting by c10d rendezvous, one worker each. --local-addr orders the
    nodes (c10d gives ranks in the order of their addresses): node 0 is rank 0 in every attempt."""
    port = free_port()
    return [Job([*TORCHRUN, "--nnodes", 2, "--nproc-per-node", 1, "--rdzv-backend", "c10d", "--rdzv-endpoint",
                 f"127.0.0.1:{port}", "--local-addr", f"127.0.0.{n + 1}", *launcher, SCRIPT,
                 "--data-dir", quick_mnist_dir, "--snapshot", snapshots[n], *TRAIN, *extra], env=env)
            for n in range(2)]


@pytest.mark.parametrize("holder", [0, 1], ids=["rank 0 has it", "rank 1 has it"])
def test_ranks_that_see_different_snapshots_all_stop_in_one_line(holder, uninterrupted, quick_mnist_dir,
                                                                 tmp_path):
    """A --snapshot path of each node's own, and the file on one node only: whichever rank sees it, no rank
    trains from scratch and none resumes alone."""
    snapshots = [tmp_path / f"node{n}" / "snapshot.pt" for n in range(2)]
    for path in snapshots:
        path.parent.mkdir()
    shutil.copy(uninterrupted.snapshot, snapshots[holder])
    nodes = two_agents(tmp_path, quick_mnist_dir, snapshots, "--max-restarts", 0, extra=["--timeout", 15])
    deadline = time.monotonic() + 60  # for both: a rank left waiting would say so after --timeout 15
    try:
        results = [node.finish(max(1, deadline - time.monotonic()), f"node {n}, the snapshots differing")
                   for n, node in enumerate(nodes)]
    finally:
        for node in nodes:
            node.kill()
    seen = {holder: "epoch 3 step 0", 1 - holder: "none"}
    for n, (returncode, _, stderr) in enumerate(results):
        errors = error_lines(stderr)
        assert returncode != 0 and len(errors) == 1, stderr
        assert errors[0] == (f"error: the ranks see different snapshots at --snapshot {snapshots[n]} (rank 0: "
                             f"{seen[0]}, rank 1: {seen[1]}): it must be on a path every node sees"), errors[0]


def test_a_restart_across_two_nodes_resumes_exactly(uninterrupted, quick_mnist_dir, tmp_path):
    """Two torchrun agents (c10d rendezvous) on one host, one snapshot path; node 1's worker is killed in
    epoch 2. Each agent counts restarts for itself, yet both attempts meet and resume from the same snapshot,
    the one rank 0 saved: epoch 1's end (snapshots at epochs' ends only; the test above resumes mid-epoch)."""
    snapshot = tmp_path / "snapshot.pt"
    nodes = two_agents(tmp_path, quick_mnist_dir, [snapshot] * 2, "--max-restarts", 3, env={"LOGLEVEL": "INFO"},
                       extra=["--log-interval", 1, "--snapshot-every", 0, "--save-model", tmp_path / "model.pt",
                              "--metrics-json", tmp_path / "metrics.json"])
    try:
        nodes[0].wait_for_line("epoch 2 step 9 ", timeout=120)  # node 0 is rank 0: it prints
        os.kill(children(nodes[1].process.pid)[0], signal.SIGKILL)
        results = [node.finish(120, f"node {n}, restarted") for n, node in enumerate(nodes)]
    finally:
        for node in nodes:
            node.kill()
    assert [returncode for returncode, _, _ in results] == [0, 0], results
    assert results[0][1].count("resuming from") == 1 and "epoch 2, step 0" in results[0][1], results[0][1]
    assert results[1][2].count(RESTARTED) == 1 and results[0][2].count(RESTARTED) <= 1, "one kill, more restarts"
    assert_same_training(tmp_path, uninterrupted)


KILL_LAUNCHES = {  # started without restarts: one killed process must end the whole job
    "spawn": lambda *args: script_command("04_ddp_spawn.py", "--nprocs", 2, "--master-port", free_port(), *args),
    "torchrun": lambda *args: script_command("06_fault_tolerant.py", "--timeout", 30, *args, nprocs=2,
                                             launcher=["--max-restarts", "0"]),
}


@pytest.mark.parametrize("launch", KILL_LAUNCHES)
def test_a_killed_rank_ends_the_job_quickly_and_says_why(launch, quick_mnist_dir):
    job = Job(KILL_LAUNCHES[launch]("--data-dir", quick_mnist_dir, "--epochs", 5, "--log-interval", 1))
    try:
        job.wait_for_line("epoch 1 step 2 ", timeout=60)
        os.kill(children(job.process.pid)[-1], signal.SIGKILL)
        killed = time.monotonic()
        returncode, _, stderr = job.finish(30, "the job, one of its ranks killed")
    finally:
        job.kill()
    took = time.monotonic() - killed
    assert returncode != 0 and took < 30, f"exit {returncode}, {took:.0f} s after the kill ({busy_note()})"
    if launch == "spawn":  # ours to word; torchrun adds its own report, traceback included
        assert "Traceback" not in stderr and "process 1: SIGKILL, killed from outside" in stderr, stderr
    else:
        assert "SIGKILL" in stderr, stderr


RESTARTABLE = [mode for mode in MODES.values() if mode.launch.torchrun]  # 03, 06, 08 and after: torchrun's


@pytest.mark.parametrize("mode", RESTARTABLE, ids=lambda mode: mode.script)
def test_a_torchrun_restart_of_any_script_trains_to_the_end(mode, quick_mnist_dir, tmp_path):
    """--max-restarts 1 and one worker killed: the new attempt must not read the killed attempt's keys in
    torchrun's store (gloo then waits for dead peers until the 30-minute timeout). It starts over, or resumes."""
    for attempt in range(1 + AGAIN):  # torch's exit abort (helpers.EXIT_ABORT) in a DTensor script: again
        out = tmp_path / str(attempt)
        out.mkdir()
        extra = ["--snapshot", out / "snapshot.pt"] if mode.snapshot else []
        job = Job(script_command(mode.script, "--data-dir", quick_mnist_dir, "--max-steps", 4, "--batch-size", 32,
                                 "--log-interval", 1, "--threads", 1, "--save-model", out / "model.pt", *extra,
                                 nprocs=processes_for(mode), launcher=["--max-restarts", "1"]),
                  env={"LOGLEVEL": "INFO"})
        try:
            job.wait_for_line("epoch 1 step 2 ", timeout=slack(120))
            os.kill(children(job.process.pid)[-1], signal.SIGKILL)
            returncode, _, stderr = job.finish(120, "the job after one worker was killed and restarted")  # a bound
        finally:
            job.kill()
        if returncode == 0 or EXIT_ABORT not in stderr:
            break
        warnings.warn(f"{mode.script}: torch aborted a worker at exit ({EXIT_ABORT}); again")
    assert returncode == 0 and stderr.count(RESTARTED) == 1, f"exit {returncode}:\n{stderr[-3000:]}"
    assert (out / "model.pt").exists(), "the restarted attempt did not save its model"


# How mp.spawn ends a worker interrupted while its parent lives: (processes, the hook's TORCH_2_15_SPAWN, what the
# one line says). As installed, torch 2.14 exits 0 as if the worker had finished, and the other worker fails on its
# lost peer; one process alone would then exit 0. The hook's cases run one process: no peer fails first.
INTERRUPTS = {
    "as installed": (2, "", ""),
    "2.15": (1, "traceback", "process 0 failed: KeyboardInterrupt"),  # the worker's traceback goes to the parent
    "2.15, exit 130 alone": (1, "exit", "process 0: SIGINT, killed from outside"),  # no traceback: nothing said
}


@pytest.mark.parametrize("script, spawn", [("04_ddp_spawn.py", "as installed"), ("04_ddp_spawn.py", "2.15"),
                                           ("04_ddp_spawn.py", "2.15, exit 130 alone"),
                                           ("05_multinode_mnist.py", "2.15, exit 130 alone")])
def test_an_interrupted_worker_ends_the_job_in_one_line(script, spawn, quick_mnist_dir, tmp_path):
    """SIGINT to one worker while its parent lives, as a Ctrl-C that reaches it alone: one line, a non-zero exit
    and no traceback, whichever way mp.spawn ends that worker (torch 2.14's, or 2.15's by the hook)."""
    nprocs, behaviour, says = INTERRUPTS[spawn]
    log = tmp_path / "wrappers.log"
    path = on_pythonpath("torch_2_15_spawn")  # torch 2.15's mp.spawn on the torch installed here
    env = dict(PYTHONPATH=path, TORCH_2_15_SPAWN=behaviour, TORCH_2_15_LOG=str(log)) if behaviour else None
    count = "--nprocs" if script == "04_ddp_spawn.py" else "-g"  # 05 as one node
    job = Job(script_command(script, count, nprocs, "--master-port", free_port(), "--data-dir", quick_mnist_dir,
                             "--epochs", 5, "--log-interval", 1), env=env)
    try:
        job.wait_for_line("epoch 1 step 2 ", timeout=slack(60))
        os.kill(children(job.process.pid)[-1], signal.SIGINT)  # the last worker started
        returncode, _, stderr = job.finish(slack(30), "the job, one of its workers interrupted")
    finally:
        job.kill()
    errors = error_lines(stderr)
    assert returncode != 0 and "Traceback" not in stderr, f"exit {returncode}:\n{stderr}"
    assert len(errors) == 1 and says in errors[0], stderr
    if behaviour:  # torch 2.15's wrapper ran in the worker
        assert f"wrap {nprocs - 1}" in log.read_text()


def test_three_jobs_at_once_on_one_host_do_not_collide(quick_mnist_dir, tmp_path):
    """Each torchrun --standalone job picks free ports of its own (one worker each: six processes would only
    make this slower on a small machine; a shared port fails with one as with two)."""
    jobs = [Job(script_command("06_fault_tolerant.py", "--data-dir", quick_mnist_dir, "--max-steps", 2,
                               "--threads", 1, "--log-interval", 0, "--metrics-json", tmp_path / f"{i}.json",
                               nprocs=1))
            for i in range(3)]
    try:
        results = [job.finish(120, f"job {i} of 3") for i, job in enumerate(jobs)]
    finally:
        for job in jobs:
            job.kill()
    assert [returncode for returncode, _, _ in results] == [0, 0, 0], [stderr for _, _, stderr in results]
    assert all(json.loads((tmp_path / f"{i}.json").read_text())["world_size"] == 1 for i in range(3))


def namespaces_available():
    return shutil.which("ip") and os.geteuid() == 0 and subprocess.run(
        ["ip", "netns", "add", "mnist-probe"], capture_output=True).returncode == 0 and not subprocess.run(
        ["ip", "netns", "delete", "mnist-probe"]).returncode


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: 10.77.0.1 (node 0) and 10.77.0.2 (node 1)."""
    if not namespaces_available():
        pytest.skip("network namespaces cannot be made here (needs root and iproute2)")
    names = [f"mnist-node{i}-{os.getpid()}" for i in range(2)]
    sh = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True)  # noqa: E731
    try:
        for name in names:
            sh("ip", "netns", "add", name)
        sh("ip", "link", "add", "veth-mn0", "netns", names[0], "type", "veth", "peer", "name", "veth-mn1",
           "netns", names[1])
        for i, name in enumerate(names):
            sh("ip", "-n", name, "addr", "add", f"10.77.0.{i + 1}/24", "dev", f"veth-mn{i}")
            sh("ip", "-n", name, "link", "set", f"veth-mn{i}", "up")
            sh("ip", "-n", name, "link", "set", "lo", "up")
        yield names
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def test_multinode_runs_between_two_hosts_like_on_loopback(two_hosts, quick_mnist_dir, tmp_path):
    args = ["--data-dir", quick_mnist_dir, "--max-steps", 4, "--log-interval", 0, "--no-dropout", "--threads", 1]
    port = free_port()

    def node(i, *extra):  # node i in its own namespace, gloo bound to that namespace's interface
        return ["ip", "netns", "exec", two_hosts[i], "env", f"GLOO_SOCKET_IFNAME=veth-mn{i}",
                *script_command("05_multinode_mnist.py", "-n", 2, "-g", 1, "--nr", i, "--master-addr", "10.77.0.1",
                                "--master-port", port, *args, *extra)]

    node1 = Job(node(1))
    try:
        run(node(0, "--metrics-json", tmp_path / "two-hosts.json"), timeout=120)
        returncode, _, stderr = node1.finish(30, "node 1 of two hosts")
        assert returncode == 0, stderr
    finally:
        node1.kill()
    run_two_nodes(*args, "--metrics-json", tmp_path / "loopback.json")
    two_hosts_record, loopback_record = (json.loads((tmp_path / f"{name}.json").read_text())
                                         for name in ("two-hosts", "loopback"))
    assert (two_hosts_record["world_size"], two_hosts_record["nodes"]) == (2, 2)
    for key in ("test_accuracy", "test_loss", "train_samples"):
        assert two_hosts_record[key] == loopback_record[key], key


def test_the_slowest_rank_sets_the_clock(quick_mnist_dir, tmp_path):
    """Rank 0 is stopped for 6 s between epochs: rank 1 waits for it in epoch 2, and the record says so."""
    job = Job(script_command("04_ddp_spawn.py", "--data-dir", quick_mnist_dir, "--nprocs", 2, "--epochs", 2,
                             "--max-steps", 2, "--log-interval", 0, "--master-port", free_port(),
                             "--metrics-json", tmp_path / "m.json"))
    try:
        job.wait_for_line("epoch 1:", timeout=60)
        spawned = [pid for pid in children(job.process.pid)
                   if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        rank0 = min(spawned)  # mp.spawn starts rank 0 first (its resource tracker is no rank)
        os.kill(rank0, signal.SIGSTOP)
        time.sleep(6)
        os.kill(rank0, signal.SIGCONT)
        returncode, _, stderr = job.finish(60, "the job after rank 0 went on")
    finally:
        job.kill()
    assert returncode == 0, stderr
    epoch2 = json.loads((tmp_path / "m.json").read_text())["epochs_detail"][1]
    assert epoch2["train_time_s"] >= 5 and epoch2["steady_time_s"] >= 5  # rank 0's own clock: well under 1 s


@pytest.mark.parametrize("script", ["03_ddp_launch.py", "04_ddp_spawn.py", "05_multinode_mnist.py",
                                    "06_fault_tolerant.py", "08_fsdp.py"])
def test_the_record_takes_the_time_of_the_slowest_rank(script, tmp_path, monkeypatch):
    """In-process, rank 0 of two: its clock reads 1 s a step, the other rank (a stand-in all-reduce) took 20 s
    for the epoch, 10 of them after the warm-up. The record has the other's seconds and its samples/s from them:
    not rank 0's own, nor a sum or a mean of the ranks'."""
    module = load_script(script)
    ticks = iter(range(100))
    monkeypatch.setattr(module, "clock", lambda device: float(next(ticks)))
    other_rank = torch.tensor([20.0, 10.0], dtype=torch.float64)  # (whole epoch, after the warm-up)

    def all_reduce(tensor, op=module.dist.ReduceOp.SUM, **kwargs):
        combine = {module.dist.ReduceOp.MAX: torch.maximum, module.dist.ReduceOp.MIN: torch.minimum,
                   module.dist.ReduceOp.SUM: torch.add, module.dist.ReduceOp.AVG: lambda a, b: (a + b) / 2}[op]
        tensor.copy_(combine(tensor, other_rank))
    monkeypatch.setattr(module.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(module.dist, "get_backend", lambda: "gloo")  # what the record asks of the group
    monkeypatch.setattr(module.dist, "is_initialized", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one node of two processes, as torchrun would say
    world = SimpleNamespace(rank=0, world_size=2, device=torch.device("cpu"), is_main=True, local_rank=0,
                            mode=by_script(script).name)
    steps, batch = module.WARMUP_STEPS + 3, 4
    epochs = []
    for _ in module.timed([(torch.zeros(batch, 1), torch.zeros(batch))] * steps, world, epochs):
        pass
    (epoch,) = epochs
    assert (epoch["train_time_s"], epoch["steady_time_s"]) == (20, 10), epoch  # rank 0's own: 6 s and 1 s
    epoch.update(epoch=1, train_loss=1.0, test_loss=1.0, test_accuracy=0.5, test_samples=10, bytes_per_rank=[1, 1],
                 full_copy_bytes=2)
    module.write_record(str(tmp_path / "m.json"), module.parse_args([]), world, epochs)
    record = json.loads((tmp_path / "m.json").read_text())
    assert record["samples_per_s"] == epoch["steady_samples"] / 10 == (steps - module.WARMUP_STEPS) * 2 * batch / 10


def test_an_interrupted_metrics_write_leaves_the_old_file_whole(quick_mnist_dir, tmp_path):
    metrics = tmp_path / "metrics.json"
    metrics.write_text('{"earlier": "run"}')
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256))  # noqa: E731  (the record is larger)
    result = run(script_command("01_single_gpu.py", "--data-dir", quick_mnist_dir, "--max-steps", 2,
                                "--metrics-json", metrics), check=False, preexec_fn=limit, timeout=60)
    assert "samples/s" in result.stdout, result.stderr  # it got as far as writing the record
    assert result.returncode != 0 and metrics.read_text() == '{"earlier": "run"}'
