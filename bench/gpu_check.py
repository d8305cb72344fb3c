"""The GPU check: what a bare GPU machine shows of this suite, in one command and a few minutes, left in one archive
and one log (for a machine lent for minutes, with no network, torch installed but perhaps not lightning).

    python bench/gpu_check.py --out /tmp/out        # the doctor, `pytest -m gpu`, a short sweep of GPU 0
    python bench/gpu_check.py --cpu --out /tmp/out  # the same steps on the CPU: to try the check itself

Writes gpu-check.log (every step's command, status, seconds and output tail) and gpu-check.tgz (the doctor's
table, the tests' report, the sweep's results) into --out; exit status 0 when every step passed. Each step has
its own bound, so that the whole check ends within about 7 minutes whatever hangs.
"""
import argparse
import importlib.util
import os
import pathlib
import sys
import tarfile
import tempfile
import time

if not __package__:  # `python bench/gpu_check.py`: the package is importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.processes import log_tail, run_processes  # noqa: E402


def steps(work, cpu):
    """(name, argv, seconds at most) of each step: 7 minutes in all. On the CPU, the doctor without its training
    runs and a sweep of 01 only: a try of the check itself, not of the CPU."""
    python = sys.executable
    where = ["--cpu", "2", "--quick"] if cpu else ["--gpus", "0"]
    tests = ([python, "-m", "pytest", "-q", "-rA", "-m", "gpu", "tests/", "--junitxml", f"{work}/gpu-tests.xml"]
             if importlib.util.find_spec("pytest") else None)  # a bare machine may lack pytest: the step says so
    sweep = (["--cpu", "1", "--modes", "01", "--epoch-images", "1280"] if cpu
             else ["--gpus", "0", "--epoch-images", "19200"])
    return [
        ("doctor", [python, "bench/doctor.py", *where, "--json", f"{work}/doctor.json"], 120),
        ("gpu tests", tests, 180),
        ("sweep", [python, "bench/run_all.py", *sweep, "--synthetic", "--epochs", "1", "--out", f"{work}/sweep"], 120),
    ]


def run_step(name, argv, limit, work):
    """Status, seconds and the log's tail of one step, its output in work/<name>.log."""
    if argv is None:
        return "skipped", 0.0, "pytest cannot be imported by this Python (pip install pytest)"
    log = os.path.join(work, f"{name.replace(' ', '-')}.log")
    started = time.monotonic()
    code, timed_out = run_processes([({}, argv)], [log], limit)
    status = f"TIMEOUT after {limit} s" if timed_out else "ok" if code == 0 else f"FAILED (exit code {code})"
    return status, time.monotonic() - started, log_tail([log], lines=40)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, metavar="FOLDER", help="where gpu-check.log and gpu-check.tgz go")
    p.add_argument("--cpu", action="store_true", help="the same steps on the CPU, to try the check itself")
    args = p.parse_args(argv)
    try:  # before minutes of work: the folder must take the results
        os.makedirs(args.out, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out).close()
    except OSError as e:
        print(f"error: cannot write in --out {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    work, failed = tempfile.mkdtemp(prefix="gpu-check-"), []
    with open(os.path.join(args.out, "gpu-check.log"), "w") as report:
        for name, command, limit in steps(work, args.cpu):
            status, seconds, tail = run_step(name, command, limit, work)
            failed += [name] if status not in ("ok", "skipped") else []
            report.write(f"== {name}: {status} in {seconds:.0f} s\n$ {' '.join(command or [])}\n{tail}\n\n")
            report.flush()
            print(f"{name}: {status} in {seconds:.0f} s", flush=True)
        report.write(f"== {'FAILED: ' + ', '.join(failed) if failed else 'every step passed'}\n")
    with tarfile.open(os.path.join(args.out, "gpu-check.tgz"), "w:gz") as archive:
        archive.add(work, arcname="gpu-check", filter=lambda f: None if f.name.endswith(".pt") else f)
    print(f"{args.out}/gpu-check.log and gpu-check.tgz" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
