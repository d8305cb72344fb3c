"""Reliability: a killed worker is restarted and resumes exactly, a save cannot be torn, failures end quickly
and clearly, jobs on one host never collide on a port, and 05 runs between two network namespaces."""
import json
import os
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TORCHRUN, free_port, run, run_two_nodes, script_command, start

# One thread per process everywhere: two "nodes" on one host would otherwise take two each, and a different
# number of threads sums in a different order (equal weights, not bitwise equal). 20 steps an epoch: snapshots
# at steps 8 and 16 and at the epoch's end.
TRAIN = ["--epochs", 2, "--max-steps", 20, "--batch-size", 32, "--log-interval", 0, "--snapshot-every", 8,
         "--threads", 1]


def children(pid):
    """Process ids whose parent is pid (what torchrun and mp.spawn start)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            kids += [int(stat.parent.name)] if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid else []
        except (OSError, IndexError, ValueError):
            pass  # the process ended while we looked
    return kids


def wait_for(condition, timeout, interval=0.005):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(interval)


def torchrun_06(out, quick_mnist_dir, *extra, launcher=()):
    args = ["--data-dir", quick_mnist_dir, "--snapshot", out / "snapshot.pt", "--save-model", out / "model.pt",
            "--metrics-json", out / "metrics.json", *TRAIN, *extra]
    out.mkdir(exist_ok=True)
    return script_command("06_fault_tolerant.py", *args, nprocs=2, launcher=launcher)


@pytest.fixture(scope="module")
def uninterrupted(quick_mnist_dir, tmp_path_factory):
    """Two epochs with dropout on: every rank's own masks must resume too."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    run(torchrun_06(out, quick_mnist_dir))
    return json.loads((out / "metrics.json").read_text()), torch.load(out / "model.pt")


def assert_same_training(out, uninterrupted):
    """Bitwise the same weights, and the same record of the epochs trained after the resume."""
    record, weights = json.loads((out / "metrics.json").read_text()), torch.load(out / "model.pt")
    reference_record, reference_weights = uninterrupted
    assert all(torch.equal(weights[k], reference_weights[k]) for k in reference_weights), "weights differ"
    last = reference_record["epochs_detail"][-1]
    assert {k: record["epochs_detail"][-1][k] for k in ("lr", "test_loss", "test_accuracy")} == {
        k: last[k] for k in ("lr", "test_loss", "test_accuracy")}  # lr: the schedule resumed too


def test_a_killed_worker_is_restarted_and_training_resumes_exactly(uninterrupted, quick_mnist_dir, tmp_path):
    out = tmp_path / "killed"
    job = start(torchrun_06(out, quick_mnist_dir, "--log-interval", 1, launcher=["--max-restarts", "3"]))
    try:  # in epoch 2, one step after its first snapshot: the schedule and the RNG must resume as well
        wait_for(lambda: job.stdout.readline().startswith("epoch 2 step 9/"), timeout=180)
        os.kill(max(children(job.pid)), signal.SIGKILL)
        stdout, stderr = job.communicate(timeout=240)
    finally:
        job.kill()
    assert job.returncode == 0, stderr
    assert "resuming from" in stdout and "epoch 2, step 8" in stdout, stdout
    assert_same_training(out, uninterrupted)


def test_resuming_at_an_epoch_end_and_with_nothing_left(uninterrupted, quick_mnist_dir, tmp_path):
    out = tmp_path / "resumed"
    run(torchrun_06(out, quick_mnist_dir, "--epochs", 1))
    assert "resuming from" in run(torchrun_06(out, quick_mnist_dir)).stdout  # at epoch 2, step 0
    assert_same_training(out, uninterrupted)
    before = (out / "metrics.json").read_bytes()
    result = run(torchrun_06(out, quick_mnist_dir))
    assert "nothing to do" in result.stderr and (out / "metrics.json").read_bytes() == before


def test_a_kill_during_a_save_leaves_the_last_snapshot_loadable(quick_mnist_dir, tmp_path):
    snapshot = tmp_path / "snapshot.pt"
    job = start(script_command("06_fault_tolerant.py", "--data-dir", quick_mnist_dir, "--snapshot", snapshot,
                               "--snapshot-every", 1, "--log-interval", 0))
    try:
        wait_for(snapshot.exists, timeout=120)
        wait_for(Path(f"{snapshot}.tmp").exists, timeout=60, interval=0.0005)  # a save is under way
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=30)
    finally:
        job.kill()
    state = torch.load(snapshot)
    assert state["epoch"] == 1 and state["step"] >= 1 and "model" in state


KILL_LAUNCHES = {  # started without restarts: one killed process must end the whole job
    "spawn": lambda *args: script_command("04_ddp_spawn.py", "--nprocs", 2, "--master-port", free_port(), *args),
    "torchrun": lambda *args: script_command("06_fault_tolerant.py", "--timeout", 30, *args, nprocs=2,
                                             launcher=["--max-restarts", "0"]),
}


@pytest.mark.parametrize("launch", KILL_LAUNCHES)
def test_a_killed_rank_ends_the_job_quickly_and_says_why(launch, quick_mnist_dir):
    job = start(KILL_LAUNCHES[launch]("--data-dir", quick_mnist_dir, "--epochs", 5, "--log-interval", 1))
    try:
        wait_for(lambda: job.stdout.readline().startswith("epoch 1 step 2/"), timeout=120)
        os.kill(max(children(job.pid)), signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode != 0 and time.monotonic() - killed < 30
    if launch == "spawn":  # ours to word; torchrun adds its own report, traceback included
        assert "Traceback" not in stderr and "process 1: SIGKILL, killed from outside" in stderr, stderr
    else:
        assert "SIGKILL" in stderr, stderr


def test_three_jobs_at_once_on_one_host_do_not_collide(quick_mnist_dir, tmp_path):
    """Each torchrun --standalone job picks free ports of its own (one worker each: six processes would only
    make this slower on a small machine; a shared port fails with one as with two)."""
    jobs = [start(script_command("06_fault_tolerant.py", "--data-dir", quick_mnist_dir, "--max-steps", 2,
                                 "--threads", 1, "--log-interval", 0, "--metrics-json", tmp_path / f"{i}.json",
                                 nprocs=1))
            for i in range(3)]
    try:
        results = [job.communicate(timeout=240) for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    assert [job.returncode for job in jobs] == [0, 0, 0], [stderr for _, stderr in results]
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

    node1 = start(node(1))
    try:
        run(node(0, "--metrics-json", tmp_path / "two-hosts.json"), timeout=240)
        assert node1.wait(timeout=60) == 0, node1.communicate()
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
    job = start(script_command("04_ddp_spawn.py", "--data-dir", quick_mnist_dir, "--nprocs", 2, "--epochs", 2,
                               "--max-steps", 2, "--log-interval", 0, "--master-port", free_port(),
                               "--metrics-json", tmp_path / "m.json"))
    try:
        wait_for(lambda: job.stdout.readline().startswith("epoch 1:"), timeout=120)
        spawned = [pid for pid in children(job.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        rank0 = min(spawned)  # mp.spawn starts rank 0 first (its resource tracker is no rank)
        os.kill(rank0, signal.SIGSTOP)
        time.sleep(6)
        os.kill(rank0, signal.SIGCONT)
        _, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, stderr
    epoch2 = json.loads((tmp_path / "m.json").read_text())["epochs_detail"][1]
    assert epoch2["train_time_s"] >= 5 and epoch2["steady_time_s"] >= 5  # rank 0's own clock: well under 1 s


def test_an_interrupted_metrics_write_leaves_the_old_file_whole(quick_mnist_dir, tmp_path):
    metrics = tmp_path / "metrics.json"
    metrics.write_text('{"earlier": "run"}')
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))  # noqa: E731  (the record is larger)
    result = run(script_command("01_single_gpu.py", "--data-dir", quick_mnist_dir, "--max-steps", 2,
                                "--metrics-json", metrics), check=False, preexec_fn=limit)
    assert "samples/s" in result.stdout, result.stderr  # it got as far as writing the record
    assert result.returncode != 0 and metrics.read_text() == '{"earlier": "run"}'


def test_every_rank_resumes_what_rank_0_saved(uninterrupted, quick_mnist_dir, tmp_path):
    """Two nodes whose snapshot paths differ (no shared disk): node 1 has none, yet both resume."""
    first = tmp_path / "node0"
    run(torchrun_06(first, quick_mnist_dir, "--epochs", 1))
    port = free_port()

    def node(rank, out):
        launcher = ["--nnodes", 2, "--node-rank", rank, "--master-addr", "127.0.0.1", "--master-port", port]
        args = ["--data-dir", quick_mnist_dir, "--snapshot", out / "snapshot.pt", "--save-model", out / "model.pt",
                "--metrics-json", out / "metrics.json", *TRAIN]
        return [*TORCHRUN, "--nproc-per-node", 1, *launcher, str(ROOT / "06_fault_tolerant.py"), *args]

    (tmp_path / "node1").mkdir()
    node1 = start([str(a) for a in node(1, tmp_path / "node1")])
    try:
        result = run([str(a) for a in node(0, first)], timeout=240)
        assert node1.wait(timeout=60) == 0, node1.communicate()
    finally:
        node1.kill()
    assert "resuming from" in result.stdout
    assert_same_training(first, uninterrupted)


def test_a_restart_across_two_nodes_resumes_exactly(uninterrupted, quick_mnist_dir, tmp_path):
    """Two torchrun agents (c10d rendezvous) on one host; node 1's worker is killed in epoch 2. Each agent
    counts restarts for itself, yet both attempts meet and resume from the same snapshot."""
    port = free_port()
    args = ["--data-dir", quick_mnist_dir, "--snapshot", tmp_path / "snapshot.pt", *TRAIN, "--log-interval", 1]
    launcher = ["--nnodes", 2, "--nproc-per-node", 1, "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--max-restarts", 3]
    nodes = [start([str(a) for a in [*TORCHRUN, *launcher, ROOT / "06_fault_tolerant.py", *args,
                                     "--save-model", tmp_path / f"model{n}.pt",
                                     "--metrics-json", tmp_path / f"metrics{n}.json"]]) for n in range(2)]
    try:
        wait_for(lambda: (tmp_path / "snapshot.pt").exists() and torch.load(tmp_path / "snapshot.pt")["epoch"] == 2
                 and torch.load(tmp_path / "snapshot.pt")["step"] == 8, timeout=240, interval=0.2)
        os.kill(children(nodes[1].pid)[0], signal.SIGKILL)
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert any("resuming from" in stdout for stdout, _ in outputs)
    rank0 = next(n for n in range(2) if (tmp_path / f"model{n}.pt").exists())  # c10d chooses which node is rank 0
    (tmp_path / "run").mkdir()
    (tmp_path / f"model{rank0}.pt").rename(tmp_path / "run" / "model.pt")
    (tmp_path / f"metrics{rank0}.json").rename(tmp_path / "run" / "metrics.json")
    assert_same_training(tmp_path / "run", uninterrupted)
