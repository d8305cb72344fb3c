"""The GPU check: the steps below, one by one and each bounded, on a bare GPU machine.

    python bench/gpu_check.py --out /tmp/out        # on GPU 0
    python bench/gpu_check.py --cpu --out /tmp/out  # the same steps on the CPU: to try the check itself

The machine may lack network, pytest, pandas or matplotlib. It writes gpu-check.log (each step's command, status,
time, bound and output tail) and gpu-check.tgz (all the steps wrote, a cut step's too) into --out. Exit status: 0
if every step passed (skipped is no pass), 1 if not, 2 if --out cannot be written. A step's bound is 1.5 x its
work; on one H200 with Lightning:

    step         what it runs                                                              work / bound
    warm up      import torch and torchvision, start CUDA (a cold machine's first import)     27 / 41 s
    doctor       bench/doctor.py --quick: its table                                           27 / 41 s
    gpu tests    01, 02 and 04 at once on CUDA; the step that never waits; the step forms      54 / 81 s
    two ranks    03, 05-12 as two ranks on GPU 0, 01 beside them; the anatomy of 03 and 08,   81 / 122 s
                 12 killed and resumed, a desync named by the flight recorder: all at once;
                 then the all-reduce measured with two ranks on GPU 0
    sweep        bench/run_all.py --modes 01: the harness, its report and plots               67 / 100 s

The bounds add up to 385 s; with 20 s more to end each step cut, 485 s whatever hangs: within a 540 s call.
The tests leave what they measured in the folder BENCH_GPU_CHECK_WORK names, which goes into the archive."""
import argparse
import contextlib
import importlib.util
import math
import os
import pathlib
import signal
import sys
import tarfile
import tempfile
import time
from xml.etree import ElementTree

if not __package__:  # `python bench/gpu_check.py`: the package is importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.processes import log_tail, run_processes  # noqa: E402

STEP_MARK = "BENCH_GPU_CHECK_STEP"  # in each step's environment, which everything it starts inherits
WORK_VARIABLE = "BENCH_GPU_CHECK_WORK"  # the folder archived: where the tests put what they measured
CUT_GRACE_S = 20  # after a cut step's SIGTERM: its runs' own SIGTERM-then-SIGKILL, then its report or table
CALL_S = 540  # the device tool's one call: the whole check, every step cut included
SPARE_S = 15  # of CALL_S, for this program's own start, its archive and the device tool
START_S = (18, 30)  # a run's start-up at its slowest, (GPU, CPU): see results/1x-nvidia-h200-gpu-check/
MARGIN = 1.5  # a step's bound over its work: the work fills at most two thirds of it
STEPS = {  # each step's work in run start-ups: (on the GPU, on the CPU), read as STEPS[name][cpu]
    "warm up": (1.5, 1),  # a cold machine's first import reads CUDA's libraries from disk
    "doctor": (1.5, 2.5),  # collect_env (1), nvidia-smi and git (0.5); on the CPU also the all-reduce (1)
    "gpu tests": (3.0, 1),  # pytest (0.5), 01, 02 and 04 at once (1.5), never-waits (0.5), step forms (0.5)
    "two ranks": (4.0, 1),  # pytest (0.5), 01, the modes and the four checks at once (3), the all-reduce (0.5)
    "sweep": (3.7, 4),  # collect_env (1.2), the loader's measurement (1), 01 (1), report and plots (0.5)
}
LIGHTNING = (0.5, 0)  # 07's two nodes, in the two ranks step where Lightning is installed
WARM_UP = """import sys, time
started = time.monotonic()
import torch, torchvision
if sys.argv[1] == "cuda":
    torch.cuda.init()  # the driver and CUDA's libraries: where they fail, the error says why
print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, CUDA available: "
      f"{torch.cuda.is_available()}; {time.monotonic() - started:.0f} s")"""


def projected(cpu):
    """{step: (its work in seconds, its bound)}, Lightning's runs counted where it is installed."""
    work = {name: starts[cpu] * START_S[cpu] for name, starts in STEPS.items()}
    if importlib.util.find_spec("lightning"):
        work["two ranks"] += LIGHTNING[cpu] * START_S[cpu]
    return {name: (seconds, math.ceil(MARGIN * seconds)) for name, seconds in work.items()}


def steps(work, cpu):
    """(name, argv, bound in seconds) of each step; without pytest, the test steps' argv is None."""
    py, has_pytest = sys.executable, importlib.util.find_spec("pytest") is not None
    tests = [py, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "tests/integration/test_gpu.py", "-m"]
    doctor = [py, "bench/doctor.py", *(["--cpu", "2"] if cpu else ["--gpus", "0"]), "--quick"]
    sweep = ["--cpu", "1", "--epoch-images", "1280"] if cpu else ["--gpus", "0", "--epoch-images", "19200"]
    argv = {
        "warm up": [py, "-c", WARM_UP, "cpu" if cpu else "cuda"],
        "doctor": [*doctor, "--json", f"{work}/doctor.json", "--logs", f"{work}/doctor"],
        "gpu tests": [*tests, "gpu and not two_ranks", "--junitxml", f"{work}/gpu-tests.xml"] if has_pytest else None,
        "two ranks": [*tests, "gpu and two_ranks", "--junitxml", f"{work}/two-ranks.xml"] if has_pytest else None,
        "sweep": [py, "bench/run_all.py", *sweep, "--modes", "01", "--synthetic", "--epochs", "1",
                  "--timeout", "90" if cpu else "60", "--out", f"{work}/sweep"],  # each run within the sweep's bound
    }
    return [(name, argv[name], bound) for name, (_, bound) in projected(cpu).items()]


def end_leftovers(mark):
    """SIGKILL each process whose environment holds the step's mark (Linux's /proc); [(pid, command)] of those."""
    needle, ended = f"{STEP_MARK}={mark}".encode(), []
    for _ in range(3):  # a parent may start another before it is killed
        for pid in (int(e) for e in (os.listdir("/proc") if os.path.isdir("/proc") else []) if e.isdigit()):
            with contextlib.suppress(OSError):  # gone meanwhile, or another user's
                if pid != os.getpid() and needle in pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    command = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    os.kill(pid, signal.SIGKILL)
                    ended.append((pid, command.decode(errors="replace").strip()))
        time.sleep(0.2 if ended else 0)
    return ended


def run_step(name, argv, limit, work):
    """Status, seconds and log tail of one step, its output in work/<name>.log. A step cut at its bound gets
    CUT_GRACE_S after SIGTERM to end what it started; then all it started is killed, in any session."""
    if argv is None:
        return "skipped", 0.0, "pytest cannot be imported by this Python (pip install pytest)"
    log, started = os.path.join(work, f"{name.replace(' ', '-')}.log"), time.monotonic()
    # The mark is this step's alone. A hung nvidia-smi or collect_env is given up on inside the step (output_of).
    env = {STEP_MARK: f"{os.getpid()}-{time.time_ns()}-{name}", "BENCH_COMMAND_TIMEOUT_S": str(int(limit / MARGIN)),
           WORK_VARIABLE: work}
    code, timed_out = run_processes([(env, argv)], [log], limit, grace=CUT_GRACE_S)
    left = end_leftovers(env[STEP_MARK])
    status = f"TIMEOUT after {limit} s" if timed_out else "ok" if code == 0 else f"FAILED (exit code {code})"
    if "--junitxml" in argv:  # pytest exits 0 when every test skipped (no CUDA): its report says what ran
        with contextlib.suppress(OSError, ElementTree.ParseError, StopIteration):  # no report: the exit status
            suite = next(ElementTree.parse(argv[argv.index("--junitxml") + 1]).iter("testsuite"))
            tests, failed, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
            status = "skipped (every test skipped)" if code == 0 and tests == skipped else status
            status += f": {tests - failed - errors - skipped} passed, {failed + errors} failed, {skipped} skipped"
    return status, time.monotonic() - started, log_tail([log], lines=40) + "".join(
        f"\n(left running by the step, killed: pid {pid} {command[:150]})" for pid, command in left)


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
    work, failed, skipped = tempfile.mkdtemp(prefix="gpu-check-"), [], []
    os.makedirs(os.path.join(work, "doctor"))  # the doctor's --logs
    with open(os.path.join(args.out, "gpu-check.log"), "w", buffering=1) as report:  # each line written at once
        planned = steps(work, args.cpu)
        report.write(f"== {len(planned)} steps, {sum(limit + CUT_GRACE_S for *_, limit in planned)} s at most\n\n")
        for name, command, limit in planned:
            status, seconds, tail = run_step(name, command, limit, work)
            (skipped if status.startswith("skipped") else [] if status.startswith("ok") else failed).append(name)
            report.write(f"== {name}: {status} in {seconds:.0f} s (bound {limit} s)\n$ {' '.join(command or [])}\n"
                         f"{tail}\n\n")
            print(f"{name}: {status} in {seconds:.0f} s", flush=True)
        verdict = "; ".join([f"FAILED: {', '.join(failed)}"] * bool(failed)
                            + [f"SKIPPED, not a pass: {', '.join(skipped)}"] * bool(skipped)) or "every step passed"
        report.write(f"== {verdict}\n")
    with tarfile.open(os.path.join(args.out, "gpu-check.tgz"), "w:gz") as archive:  # a cut step's files too
        archive.add(work, arcname="gpu-check", filter=lambda f: None if f.name.endswith((".pt", ".distcp")) else f)
    print(f"{args.out}/gpu-check.log and gpu-check.tgz; {verdict}")
    return 1 if failed or skipped else 0


if __name__ == "__main__":
    sys.exit(main())
