"""The harness's checks before it measures, in this process: each run's timeout follows its estimate, runs inherit
nothing of a SLURM job or launcher around the harness, and busy GPUs are flagged (the checks in a real sweep:
tests/integration/test_preflight.py)."""
import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest

from bench import outputs, plan, processes, report, sweep
from bench.commands import repo_relative
from bench.family import REPO
from bench.flags import BadArgument
from bench.run_all import check_no_stray_runs
from helpers import fake_command, gpu_settings


def test_each_runs_timeout_follows_its_estimate_unless_given():
    settings = dataclasses.replace(gpu_settings([]), timeout=None, epochs=1, epoch_images=100 * 64)
    run = plan.Run("base", (), "ddp_launch", 2, 64, 1)
    estimate = plan.estimate_s(run, settings)
    assert plan.timeout_s(run, settings) == plan.TIMEOUT_FACTOR * estimate + plan.TIMEOUT_SLACK_S
    assert plan.timeout_s(run, dataclasses.replace(settings, epochs=10)) > plan.timeout_s(run, settings)
    assert plan.timeout_s(run, dataclasses.replace(settings, timeout=42.0)) == 42.0
    assert plan.timeout_s(run, settings) < 600  # below NCCL's 10-minute watchdog: a hang costs less


def test_runs_inherit_nothing_of_a_slurm_job_or_launcher_around_the_harness(monkeypatch):
    """Inside `sbatch --ntasks-per-node=1`, Lightning would read the job's one task per node and 07 would exit 2
    at n = 2; under a launcher, RANK and WORLD_SIZE would be the harness's own (tests/integration/test_slurm.py runs the
    harness in a real batch job)."""
    job = {"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "1", "RANK": "3", "WORLD_SIZE": "4",
           "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "1",
           "TORCHELASTIC_RUN_ID": "x", "OMPI_COMM_WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "0,1"}
    for key, value in job.items():
        monkeypatch.setenv(key, value)
    env = processes.run_environment({"CUDA_VISIBLE_DEVICES": "1"})
    assert not (set(job) - {"CUDA_VISIBLE_DEVICES"}) & set(env), env
    assert (env["CUDA_VISIBLE_DEVICES"], env["PYTHONUNBUFFERED"], env["PATH"]) == ("1", "1", os.environ["PATH"])


@pytest.fixture
def busy_gpu(tmp_path):
    """An nvidia-smi of two GPUs whose GPU 0 holds 30 GiB for another user's process."""
    return {**fake_command(tmp_path, "nvidia-smi", {
        "--query-gpu=index,uuid,name --format=csv,noheader": "0, GPU-0000, NVIDIA H200\n1, GPU-0001, NVIDIA H200",
        "--query-gpu=index,uuid,memory.used --format=csv,noheader,nounits": "0, GPU-0000, 30800\n1, GPU-0001, 3",
        "--query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits":
            "GPU-0000, 4242, /usr/bin/python3, 30720"}), "CUDA_VISIBLE_DEVICES": None}


def test_a_run_on_a_gpu_that_another_process_holds_is_flagged(tmp_path, busy_gpu, monkeypatch, capsys):
    """Asked of nvidia-smi just before the run starts (the run itself a stand-in here: no GPU to train on)."""
    for key, value in busy_gpu.items():
        monkeypatch.setenv(key, value) if value is not None else monkeypatch.delenv(key, raising=False)

    def stand_in(cmds, logs, timeout):  # exits 0 at once, writing its logs and no record
        for log in logs:
            pathlib.Path(log).write_text("")
        return 0, False
    monkeypatch.setattr(sweep, "run_processes", stand_in)
    for name in ("logs", "metrics"):
        (tmp_path / name).mkdir()
    on_gpu = {"0": plan.Run("base", (), "single", 1, 16, 1), "1": plan.Run("base", (), "single", 1, 16, 2)}
    rows = []
    for gpu, run in on_gpu.items():
        rows += sweep.run_plan([run], {}, gpu_settings([gpu]), str(tmp_path), {})
        flagged = rows[-1]["busy_before"]
        assert ("GPU 0: 30800 MiB in use by pid 4242 python3" in flagged) == (gpu == "0"), (gpu, flagged)
    out = capsys.readouterr().out
    assert out.count("WARNING") == 1 and "pid 4242" in out
    outputs.write_runs(str(tmp_path), rows)
    frame, summary = report.read_and_summarize(str(tmp_path))
    env = dict(hardware="1x NVIDIA H200", harness_command="python bench/run_all.py", python=sys.executable)
    report.write_report(str(tmp_path), frame, summary, env, gpu_settings(["0"]), [], [])
    busy_section = (tmp_path / "report.md").read_text().split("## Runs on busy GPUs")[1].split("##")[0]
    assert "single-n1-b16-r1: GPU 0: 30800 MiB" in busy_section and "r2" not in busy_section


def test_resume_sees_a_stray_run_whose_metrics_path_is_relative_to_the_repository(tmp_path):
    """A sweep into the default folder (results/<label>, inside the repository) starts its runs with
    --metrics-json relative to the repository, as a user would type it: a stray of such a sweep names no absolute
    path, and must still stop --resume."""
    out = os.path.join(REPO, "results", f"stray-test-{os.getpid()}-{tmp_path.name}")  # never created
    metrics = repo_relative(os.path.join(out, "metrics", "single-n1-b16-r1.json"))
    assert not os.path.isabs(metrics), metrics  # what the harness passes (bench.commands.commands)
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "--metrics-json", metrics],
                             cwd=REPO)
    try:
        with pytest.raises(BadArgument) as refused:
            check_no_stray_runs(out)
    finally:
        stray.kill()
        stray.wait()
    assert f"pid {stray.pid}" in str(refused.value) and "still running" in str(refused.value)
