"""The GPU check: what a bare GPU machine shows of this suite, in one command and a few minutes, left in one archive
and one log (for a machine lent for minutes, with no network, torch installed but perhaps not lightning).

    python bench/gpu_check.py --out /tmp/out        # the doctor, `pytest -m gpu`, a short sweep of GPU 0
    python bench/gpu_check.py --cpu --out /tmp/out  # the same steps on the CPU: to try the check itself

Writes gpu-check.log (every step's command, status, seconds and output tail) and gpu-check.tgz (the doctor's
table, the tests' report, the sweep's results) into --out; exit status 0 when every step passed. Each step has
its own bound, so that the whole check ends within about 7 minutes whatever hangs.
"""
import argparse
import contextlib
import importlib.util
import os
import pathlib
import signal
import sys
import tarfile
import tempfile
import time

if not __package__:  # `python bench/gpu_check.py`: the package is importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.processes import log_tail, run_processes  # noqa: E402

STEP_MARK = "BENCH_GPU_CHECK_STEP"  # in each step's environment, which everything it starts inherits
CUT_GRACE_S = 20  # after a step's SIGTERM: its runs' own SIGTERM-then-SIGKILL (5 s) and its report or table


def steps(work, cpu):
    """(name, argv, seconds at most) of each step: 7 minutes in all. On the CPU, the doctor without its training
    runs and a sweep of 01 only: a try of the check itself, not of the CPU."""
    python = sys.executable
    where = ["--cpu", "2", "--quick"] if cpu else ["--gpus", "0"]
    tests = ([python, "-m", "pytest", "-q", "-rA", "-m", "gpu", "tests/", "--junitxml", f"{work}/gpu-tests.xml"]
             if importlib.util.find_spec("pytest") else None)  # a bare machine may lack pytest: the step says so
    sweep = ["--cpu", "1", "--modes", "01", "--max-steps", "20"] if cpu else ["--gpus", "0", "--max-steps", "300"]
    return [
        ("doctor", [python, "bench/doctor.py", *where, "--json", f"{work}/doctor.json"], 120),
        ("gpu tests", tests, 180),
        ("sweep", [python, "bench/run_all.py", *sweep, "--synthetic", "--epochs", "1", "--out", f"{work}/sweep"], 120),
    ]


def marked(value):
    """[(pid, command)] of the processes whose environment holds STEP_MARK=value: Linux's /proc (elsewhere none are
    found, and only the step's own process group is ended)."""
    needle, found = f"{STEP_MARK}={value}".encode(), []
    for pid in (int(e) for e in (os.listdir("/proc") if os.path.isdir("/proc") else []) if e.isdigit()):
        with contextlib.suppress(OSError):  # gone meanwhile, or another user's
            if pid != os.getpid() and needle in pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                command = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                found.append((pid, command.decode(errors="replace").strip()))
    return found


def end_leftovers(value):
    """SIGKILL every process the step left (in a session of its own, or its parent killed first); those it ended."""
    ended = []
    for _ in range(3):  # a parent may start another before it is killed
        left = marked(value)
        for pid, _ in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        ended += left
        time.sleep(0.2 if left else 0)
    return ended


def run_step(name, argv, limit, work):
    """Status, seconds and the log's tail of one step, its output in work/<name>.log. A step cut at its bound gets
    CUT_GRACE_S after SIGTERM to end what it started (and write what it has), then its group is killed; whatever
    it started still runs after that, in any session (its environment holds the step's mark), is killed too."""
    if argv is None:
        return "skipped", 0.0, "pytest cannot be imported by this Python (pip install pytest)"
    log = os.path.join(work, f"{name.replace(' ', '-')}.log")
    started, mark = time.monotonic(), f"{os.getpid()}-{time.time_ns()}-{name}"
    code, timed_out = run_processes([({STEP_MARK: mark}, argv)], [log], limit, grace=CUT_GRACE_S)
    left = end_leftovers(mark)
    status = f"TIMEOUT after {limit} s" if timed_out else "ok" if code == 0 else f"FAILED (exit code {code})"
    tail = log_tail([log], lines=40) + "".join(f"\n(left running by the step, killed: pid {pid} {command[:150]})"
                                               for pid, command in left)
    return status, time.monotonic() - started, tail


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
