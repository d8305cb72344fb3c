"""A sweep stopped by SIGTERM (the GPU check's bound, a scheduler's) or Ctrl-C still leaves report.md and the plots
of the runs that finished, naming those it did not run, and ends its run under way."""
import signal
import sys
import time

from helpers import start, stop


def test_a_sweep_stopped_by_sigterm_writes_the_report_and_plots_of_its_finished_runs(tmp_path):
    out = tmp_path / "sweep"
    sweep = start([sys.executable, "bench/run_all.py", "--cpu", "1", "--modes", "01,02", "--synthetic", "--epochs",
                   "1", "--epoch-images", "320", "--out", str(out)])
    try:
        deadline = time.monotonic() + 400
        while not (out / "runs.csv").exists():  # written once the first run (01) has finished
            assert sweep.poll() is None and time.monotonic() < deadline, sweep.communicate()
            time.sleep(0.2)
        sweep.send_signal(signal.SIGTERM)  # during 02, the second run
        _, stderr = sweep.communicate(timeout=120)
    finally:
        stop([sweep])
    assert sweep.returncode == 130 and "Traceback" not in stderr, stderr
    assert "report of the finished runs" in stderr
    report = (out / "report.md").read_text()
    assert "| single | 1 |" in report, report
    assert "dp-n1-b64-r1 (not run: the sweep was interrupted; --resume runs it)" in report, report
    assert (out / "throughput.png").exists() and (out / "summary.csv").exists()
