"""The harness checks the machine before it measures: a collective that cannot connect skips the runs that need it
(the sweep ends in a minute or two, not hours), each run's timeout follows its estimate, runs inherit nothing of a
SLURM job or launcher around the harness, busy GPUs are flagged, and --resume refuses while an earlier sweep's
runs still train."""
import dataclasses
import subprocess
import sys
import time

import pytest

from bench import plan, processes
from tests.test_bench import TINY, environment, executable, gpu_settings, harness, read_runs

QUICK = ["--cpu", "2", "--synthetic", "--epochs", "1", *TINY]


def test_a_collective_that_cannot_connect_skips_the_runs_that_need_it_and_says_why(tmp_path):
    """gloo told to use an interface that does not exist: the all-reduce before the sweep fails, so 03 and 05 at
    n = 2 are not started (each would fail or hang on its own); 01 still runs. The whole sweep takes about a
    minute: the harness's run of the collective and 01."""
    started = time.monotonic()
    result = harness(*QUICK, "--modes", "01,03,05", "--out", tmp_path / "out",
                     env={"GLOO_SOCKET_IFNAME": "nosuchif"}, timeout=300)
    took = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    runs = read_runs(tmp_path / "out").set_index("run_id")
    assert runs.loc["single-n1-b16-r1", "status"] == "ok"
    for skipped in ("ddp_launch-n2-b16-r1", "ddp_multinode-n2-b16-r1"):
        assert runs.loc[skipped, "status"] == "skipped", runs.loc[skipped]
        assert "all-reduce at n = 2 failed" in runs.loc[skipped, "error"]
        assert "GLOO_SOCKET_IFNAME" in runs.loc[skipped, "error"]  # the fix, from bench.checks.advice
    report = (tmp_path / "out" / "report.md").read_text()
    assert "ddp_launch-n2-b16-r1" in report and "all-reduce at n = 2 failed" in report
    assert took < 240, took


def test_a_resumed_sweep_tries_a_failed_collective_again(tmp_path):
    out = tmp_path / "out"
    harness(*QUICK, "--modes", "03", "--out", out, env={"GLOO_SOCKET_IFNAME": "nosuchif"}, timeout=300)
    assert read_runs(out)["status"].tolist() == ["skipped"]
    result = harness(*QUICK, "--modes", "03", "--out", out, "--resume", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert read_runs(out)["status"].tolist() == ["ok"]


def test_each_runs_timeout_follows_its_estimate_unless_given():
    settings = dataclasses.replace(gpu_settings([]), timeout=None, epochs=1, max_steps=100)
    run = plan.Run("base", (), "ddp_launch", 2, 64, 1)
    estimate = plan.estimate_s(run, settings)
    assert plan.timeout_s(run, settings) == plan.TIMEOUT_FACTOR * estimate + plan.TIMEOUT_SLACK_S
    assert plan.timeout_s(run, dataclasses.replace(settings, epochs=10)) > plan.timeout_s(run, settings)
    assert plan.timeout_s(run, dataclasses.replace(settings, timeout=42.0)) == 42.0
    assert plan.timeout_s(run, settings) < 600  # below NCCL's 10-minute watchdog: a hang costs less


def test_runs_inherit_nothing_of_a_slurm_job_or_launcher_around_the_harness(tmp_path):
    """Inside `sbatch --ntasks-per-node=1`, Lightning would read the job's one task per node and 07 would exit 2
    at n = 2; under a launcher, RANK and WORLD_SIZE would be the harness's own."""
    job = {"SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "sweep", "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1",
           "SLURM_NNODES": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_PORT": "1"}
    env = processes.run_environment({"CUDA_VISIBLE_DEVICES": ""})
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["PYTHONUNBUFFERED"] == "1"
    modes = "07,03" if not plan.unavailable_reason("lightning") else "03"
    result = harness(*QUICK, "--modes", modes, "--out", tmp_path / "out", env=job, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr + str(read_runs(tmp_path / "out")["log_tail"])


@pytest.fixture
def busy_gpu(tmp_path):
    """An nvidia-smi whose GPU 0 holds 30 GiB for another user's process, and a harness Python whose CUDA is
    absent (so every GPU run fails quickly, as runs on a fake machine must)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "nvidia-smi", """#!/bin/sh
case "$*" in
  *query-compute-apps*) echo 'GPU-0000, 4242, /usr/bin/python3, 30720' ;;
  *query-gpu=index,uuid,memory.used*) echo '0, GPU-0000, 30800'; echo '1, GPU-0001, 3' ;;
  topo*) exit 1 ;;
  *) echo '0, GPU-0000, NVIDIA H200'; echo '1, GPU-0001, NVIDIA H200' ;;
esac
""")
    return {"PATH": f"{bin_dir}:{environment(None)['PATH']}", "CUDA_VISIBLE_DEVICES": None}


def test_a_run_on_a_gpu_that_another_process_holds_is_flagged(tmp_path, busy_gpu):
    result = harness("--gpus", "0", "--modes", "01", "--synthetic", *TINY, "--out", tmp_path / "out", env=busy_gpu,
                     timeout=300)
    row = read_runs(tmp_path / "out").iloc[0]
    assert "GPU 0: 30800 MiB in use by pid 4242 python3" in row["busy_before"], row
    assert "busy" in result.stdout and "pid 4242" in result.stdout


def test_resume_refuses_while_runs_of_the_earlier_sweep_still_train(tmp_path):
    out = tmp_path / "out"
    (out / "metrics").mkdir(parents=True)
    (out / "runs.csv").write_text("run_id\n")
    # A run left behind by a killed harness: its command line names the sweep's metrics folder.
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "--metrics-json",
                              str(out / "metrics" / "single-n1-b16-r1.json")])
    try:
        result = harness(*QUICK, "--modes", "01", "--out", out, "--resume", timeout=120)
    finally:
        stray.kill()
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"pid {stray.pid}" in result.stderr and "still running" in result.stderr
