"""The harness checks the machine before it measures, run as a user runs it: a collective that cannot connect
skips the runs that need it (the sweep ends in a minute or two, not hours), and --resume refuses while an earlier
sweep's runs still train (the checks in this process: tests/unit/test_preflight_checks.py)."""
import subprocess
import sys
import time

from helpers import TINY, busy_note, harness, read_runs

QUICK = ["--cpu", "2", "--synthetic", "--epochs", "1", *TINY]


def test_a_collective_that_cannot_connect_skips_the_runs_that_need_it_and_resume_tries_it_again(tmp_path):
    """gloo told to use an interface that does not exist: the all-reduce before the sweep fails, so 03 at n = 2 is
    not started (it would fail or hang on its own), saying why and what to do; 01 still runs. --resume, the
    interface setting gone, measures the all-reduce again and runs 03."""
    out = tmp_path / "out"
    started = time.monotonic()
    result = harness(*QUICK, "--modes", "01,03", "--out", out, env={"GLOO_SOCKET_IFNAME": "nosuchif"}, timeout=300)
    took = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    runs = read_runs(out).set_index("run_id")
    assert runs.loc["single-n1-b16-r1", "status"] == "ok"
    skipped = runs.loc["ddp_launch-n2-b16-r1"]
    assert skipped["status"] == "skipped" and "all-reduce at n = 2 failed" in skipped["error"], skipped
    assert "GLOO_SOCKET_IFNAME" in skipped["error"]  # the fix, from bench.checks.advice
    report = (out / "report.md").read_text()
    assert "ddp_launch-n2-b16-r1" in report and "all-reduce at n = 2 failed" in report
    # The collective's bound and 01, not a run timeout per skipped run.
    assert took < 240, f"{took:.0f} s ({busy_note()})"
    result = harness(*QUICK, "--modes", "01,03", "--out", out, "--resume", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert read_runs(out)["status"].tolist() == ["ok", "ok"]


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
