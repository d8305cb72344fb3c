"""A doctor, a pytest or a GPU-check step killed at its bound ends every process it started, whatever session that
runs in: none is left holding a GPU (possibly inside NCCL) for the next step. Each stand-in run carries a unique
marker in its argv, and the test looks for any process that still has it."""
import json
import signal
import subprocess
import sys
import time
import uuid

from helpers import ROOT, start, stop
from bench import gpu_check
from bench.processes import processes_mentioning

PY = sys.executable
# A run as torchrun's is: a parent and a worker in its process group, both with the marker (argv[1]) in argv.
RUN_WITH_A_WORKER = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                     "'import time; time.sleep(600)', sys.argv[1] + '-worker']); time.sleep(600)")


def marker():
    return f"orphan-check-{uuid.uuid4().hex}"


def wait_until(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{timeout} s passed before {what}"
        time.sleep(0.2)


def kill_marked(mark):
    """After a failure: what the test would have left (by pid, and only those that carry its own marker)."""
    for pid, _ in processes_mentioning(mark):
        subprocess.run(["kill", "-9", str(pid)])


def left_with(mark, settle=3):
    """The processes that still carry the mark, after a few seconds for the last ones to exit."""
    deadline = time.monotonic() + settle
    while processes_mentioning(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    return processes_mentioning(mark)


# The doctor with every training run stood in by RUN_WITH_A_WORKER, marked from the environment (so that the
# doctor's own argv does not carry the marker).
DOCTOR_WITH_STAND_IN_RUNS = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from bench import doctor, sweep
run = [sys.executable, "-c", {RUN_WITH_A_WORKER!r}, os.environ["STAND_IN_MARK"], "--batch-size", "16"]
sweep.commands = lambda *args: [({{}}, run)]
sys.exit(doctor.main(["--cpu", "1", "--json", sys.argv[1]]))
"""


def test_a_doctor_killed_by_sigterm_ends_its_runs_and_their_workers_and_says_so(tmp_path):
    mark, report = marker(), tmp_path / "doctor.json"
    doctor = start([PY, "-c", DOCTOR_WITH_STAND_IN_RUNS, str(report)], env={"STAND_IN_MARK": mark})
    try:
        # its first runs and their workers, in sessions of their own (run_processes starts runs so)
        wait_until(lambda: len(processes_mentioning(mark)) >= 2 or doctor.poll() is not None, 400,
                   "the doctor's first training runs started (collect_env took 69 s on this VM at load 12)")
        assert doctor.poll() is None, doctor.communicate()
        doctor.send_signal(signal.SIGTERM)  # the doctor alone, not its group: its handler must end the runs
        _, stderr = doctor.communicate(timeout=30)
        assert doctor.returncode == 130, stderr
        assert left_with(mark) == []
        rows = {r["check"]: r for r in json.loads(report.read_text())["rows"]}
        assert rows["interrupted"]["status"] == "FAIL" and rows["devices"]["status"] == "ok"
        assert "Traceback" not in stderr
    finally:
        stop([doctor])
        kill_marked(mark)


def test_a_gpu_check_step_deaf_to_sigterm_is_ended_with_what_it_started_in_another_session(tmp_path, monkeypatch):
    mark = marker()
    deaf = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"subprocess.Popen([sys.executable, '-c', {RUN_WITH_A_WORKER!r}, sys.argv[1]], start_new_session=True); "
            "time.sleep(600)")
    monkeypatch.setattr(gpu_check, "steps", lambda work, cpu: [("deaf", [PY, "-c", deaf, mark + "-step"], 3)])
    monkeypatch.setattr(gpu_check, "CUT_GRACE_S", 1)
    started = time.monotonic()
    try:
        assert gpu_check.main(["--out", str(tmp_path / "out")]) == 1
        assert time.monotonic() - started < 30
        assert left_with(mark) == []
    finally:
        kill_marked(mark)
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert "== deaf: TIMEOUT after 3 s" in log and log.count("left running by the step, killed") == 2, log


def test_start_puts_a_command_in_a_group_of_its_own_that_stop_ends_whole():
    mark = marker()
    job = start([PY, "-c", RUN_WITH_A_WORKER, mark])
    try:
        wait_until(lambda: len(processes_mentioning(mark)) == 2, 60, "the command and its worker started")
        stop([job])
        assert left_with(mark) == []
    finally:
        kill_marked(mark)


TEST_THAT_RUNS_A_JOB = f"""
import sys
sys.path.insert(0, {str(ROOT / "tests")!r})
from helpers import run

def test_a_long_job():
    run([sys.executable, "-c", {RUN_WITH_A_WORKER!r}, {{mark!r}}], timeout=600)
"""


def test_pytest_killed_by_sigterm_ends_the_jobs_its_tests_run(tmp_path):
    mark = marker()
    (tmp_path / "test_job.py").write_text(TEST_THAT_RUNS_A_JOB.format(mark=mark))
    tests = start([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                   str(tmp_path / "test_job.py"), "--junitxml", str(tmp_path / "report.xml")])
    try:
        wait_until(lambda: len(processes_mentioning(mark)) == 2 or tests.poll() is not None, 180,
                   "the test's job started")
        assert tests.poll() is None, tests.communicate()
        tests.send_signal(signal.SIGTERM)
        tests.communicate(timeout=30)
        assert left_with(mark) == []
        assert (tmp_path / "report.xml").exists()  # the report of an interrupted pytest is still written
    finally:
        stop([tests])
        kill_marked(mark)
