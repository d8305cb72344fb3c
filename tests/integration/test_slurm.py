"""slurm/multinode.sbatch under a real scheduler: a private SLURM cluster of two nodes on this host
(slurm/local_cluster.py) runs the batch script as a user submits it. Only what a CPU host lacks is overridden on
the sbatch command line: no GPUs (--gpus-per-node=0, PROCS_PER_NODE, 05's --cpu) and the host's cores instead of
16 per task."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import QUICK_TEST_IMAGES, ROOT

sys.path.insert(0, str(ROOT / "slurm"))
from local_cluster import NODES, local_cluster, missing_requirements  # noqa: E402

CANNOT_RUN = missing_requirements()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(CANNOT_RUN is not None, reason=str(CANNOT_RUN))]
CPUS = len(os.sched_getaffinity(0))  # what each node of the local cluster offers (each is this host)
JOB_TIMEOUT_S = 150  # a job that hangs fails the test; the cluster's stop cancels it
KILL_BOUND_S = 15  # a killed task ends the whole job, every process of it, within this


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The environment that reaches the cluster; its daemons are stopped by pid, also when a test fails."""
    with local_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env


def submit(env, folder, procs_per_node, *args, wait=True):
    """sbatch the batch script from the repository root, with this venv's python first on PATH as a user would."""
    command = ["sbatch", "--parsable", *(["--wait"] if wait else []), "--gpus-per-node=0",
               f"--cpus-per-task={CPUS}", f"--output={folder}/job-%j.out", "slurm/multinode.sbatch", "--cpu",
               *map(str, args)]
    env = {**env, "PROCS_PER_NODE": str(procs_per_node), "PYTHONUNBUFFERED": "1",
           "PATH": f"{os.path.dirname(sys.executable)}:{env['PATH']}"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def job_output(folder):
    return "\n".join(path.read_text() for path in sorted(folder.glob("job-*.out")))


def job_state(env, job_id):
    result = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True,
                            timeout=10)
    found = re.search(r"JobState=(\S+)", result.stdout)
    return found.group(1) if found else "forgotten"  # the cluster keeps a finished job's record 5 s (MinJobAge)


def job_processes(env, job_id, node):
    """Rows of `scontrol listpids` for the job on a node: PID JOBID STEPID LOCALID GLOBALID."""
    result = subprocess.run(["scontrol", "listpids", job_id, node], env=env, capture_output=True, text=True,
                            timeout=10)
    return [line.split() for line in result.stdout.splitlines()[1:]] if result.returncode == 0 else []


def task_pid(env, job_id, node):
    """The pid of the job step's task on a node (05's main process there), or None before it starts."""
    return next((int(row[0]) for row in job_processes(env, job_id, node) if row[2] == "0" and row[3] == "0"), None)


def final_state(env, job_id):
    """The job's final state once it has ended and none of its processes is left on any node, else None."""
    state = job_state(env, job_id)
    if state in ("PENDING", "RUNNING", "COMPLETING"):
        return None
    left = [row for node in NODES for row in job_processes(env, job_id, node)]
    return None if left else state


def wait_until(condition, timeout, what):
    """condition()'s first true value, polled every 0.2 s."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.2)
    return value


def test_batch_script_trains_on_two_nodes(cluster, quick_mnist_dir, tmp_path):
    """World size = nodes x processes per node, every test image counted once, the task's CPUs shared out."""
    metrics = tmp_path / "metrics.json"
    job = submit(cluster, tmp_path, 2, "--data-dir", quick_mnist_dir, "--max-steps", 2, "--log-interval", 0,
                 "--metrics-json", metrics)
    try:
        stdout, stderr = job.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        job.kill()
    assert job.returncode == 0, f"sbatch exited {job.returncode}: {stderr}\n{job_output(tmp_path)}"
    record = json.loads(metrics.read_text())
    assert (record["nodes"], record["world_size"]) == (2, 2 * 2)
    assert record["epochs_detail"][0]["test_samples"] == QUICK_TEST_IMAGES
    assert record["threads"] == max(1, CPUS // 2), "threads per process: the task's CPUs / processes per node"


def test_a_killed_task_ends_the_whole_job(cluster, tmp_path):
    """Node 1's task killed as soon as it runs, before its processes join node 0's: the worst case, where node 0
    would wait for them for PyTorch's rendezvous timeout (30 min). srun ends the job at once, and says why."""
    job = submit(cluster, tmp_path, 1, "--synthetic", "--log-interval", 0, wait=False)
    try:
        job_id = job.communicate(timeout=30)[0].strip()
        wait_until(lambda: task_pid(cluster, job_id, NODES[1]), JOB_TIMEOUT_S, "the start of node 1's task")
        os.kill(task_pid(cluster, job_id, NODES[1]), signal.SIGKILL)
        killed_at = time.monotonic()
        state = wait_until(lambda: final_state(cluster, job_id), KILL_BOUND_S, "the job's end after the kill")
        print(f"the job and all its processes ended {time.monotonic() - killed_at:.1f} s after the kill")
    finally:
        job.kill()
    assert state == "FAILED"
    output = job_output(tmp_path)
    assert f"{NODES[1]}: task 1: Killed" in output, output


def test_the_harness_inside_a_batch_job_sweeps_every_mode_it_is_given_07_included(cluster, tmp_path):
    """`sbatch --ntasks-per-node=1` around the harness, as users get GPUs on a cluster: its runs inherit none of
    the job's SLURM_* variables, so Lightning does not take the job's one task per node for 07's layout."""
    out = tmp_path / "sweep"
    sweep = [sys.executable, "bench/run_all.py", "--cpu", "2", "--synthetic", "--modes", "03,07", "--epochs", "1",
             "--epoch-images", "96", "--per-gpu-batch", "16", "--out", str(out)]
    command = ["sbatch", "--parsable", "--wait", "--nodes=1", "--ntasks-per-node=1", f"--cpus-per-task={CPUS}",
               "--job-name=sweep", f"--output={tmp_path}/job-%j.out", "--wrap", subprocess.list2cmdline(sweep)]
    job = subprocess.run(command, cwd=ROOT, env=cluster, capture_output=True, text=True, timeout=2 * JOB_TIMEOUT_S)
    assert job.returncode == 0, f"sbatch exited {job.returncode}: {job.stderr}\n{job_output(tmp_path)}"
    runs = (out / "runs.csv").read_text()
    assert "ddp_launch-n2-b16-r1" in runs and "lightning-n2-b16-r1" in runs and ",failed," not in runs, runs
