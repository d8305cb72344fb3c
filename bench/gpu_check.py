"""The GPU check: what a bare GPU machine shows of this suite, in one command and a few minutes, left in one archive
and one log (for a machine lent for minutes, with no network, torch installed but perhaps not lightning, pytest,
pandas or matplotlib).

    python bench/gpu_check.py --out /tmp/out        # warm-up, doctor, GPU tests, step forms, a short sweep of GPU 0
    python bench/gpu_check.py --cpu --out /tmp/out  # the same steps on the CPU: to try the check itself

Writes gpu-check.log (every step's command, status, seconds, bound and output tail) and gpu-check.tgz (the doctor's
table and logs, the tests' reports, the step forms' JSON, the sweep's results, a cut step's too) into --out; exit
status 0 when every step passed (a skipped one is no pass).

A lent H200 runs it in one call of at most CALL_S, 540 s. Each step has its own bound: 1.5 x its projected work,
counted in run start-ups of 18 s (WORK). A cut step has CUT_GRACE_S, 20 s, more to end what it started. On one
H200 with Lightning, step by step, projected work / bound:

    warm up      import torch and torchvision, start CUDA (a cold machine's first import)     27 / 41 s
    doctor       bench/doctor.py --quick: its table                                           27 / 41 s
    gpu tests    01, 02 and 04 at once on CUDA; the step that never waits; the CUDA graph     45 / 68 s
    two ranks    03, 05-09 as two ranks on GPU 0, 01 beside them, all at once                 63 / 95 s
    step forms   01's step eager, compiled and as one CUDA graph (bench/measure/step_forms)   36 / 54 s
    sweep        bench/run_all.py --modes 01: the harness, its report and plots               67 / 100 s

The bounds add up to 399 s; with 20 s more for each step cut, 519 s whatever hangs, which leaves 21 s for this
program's own start, its archive and the device tool. Without Lightning the two ranks step is 54 / 81 s.
"""
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
CUT_GRACE_S = 20  # after a step's SIGTERM: its runs' own SIGTERM-then-SIGKILL (5 s) and its report or table
RUN_TIMEOUT_S = dict(gpu=60, cpu=90)  # the sweep's runs (--timeout): 3 x START_S, under the sweep's own bound
CALL_S = 540  # the device tool's one call on a lent GPU machine: the whole check, every step cut included
SPARE_S = 15  # of CALL_S, kept for this program's own start, its archive and the device tool


# The work of each step, in run start-ups: 10-18 s each on one H200 before a run trains (imports, CUDA, data;
# results/1x-nvidia-h200-gpu-check: 18.0, 17.2, 20.1 and 24.8 s for 3 epochs of which 7 s train, 61 s for the 4
# start-ups of the gpu test), while the training itself takes a second or two. Each step's bound is MARGIN x its
# work at the slowest start-up, so that the work fills at most two thirds of it. On the CPU (--cpu) a start-up is
# taken as 30 s (18 s on a quiet 2-core VM, plan.START_S; collect_env alone took 25-69 s on a busy one).
START_S = dict(gpu=18, cpu=30)
MARGIN = 1.5
WORK = dict(
    # One start-up, half again for a cold machine: its first import reads the CUDA libraries from disk. The
    # doctor's torch report then starts warm (cold, it once ran out of time and read "torch cannot use CUDA").
    warm_up=dict(gpu=1.5, cpu=1),
    # --quick: torch's collect_env in a child (1 start-up), nvidia-smi and git (0.5). Its training runs would add a
    # start-up per mode, which the tests pay for already.
    doctor=dict(gpu=1.5, cpu=2.5),  # on the CPU also the all-reduce at n = 2 (one start-up)
    # pytest and conftest's imports (0.5); 01, 02 and 04 at once (1.5: four processes, 04's spawn counted, on 16
    # cores); in pytest's process, the step that never waits and the CUDA graph's check (0.5)
    gpu_tests=dict(gpu=2.5, cpu=1),  # on the CPU: collection only, every test skips
    # pytest (0.5); 01, and 03, 05, 06, 08 and 09 as two nodes each, at once (2.5: 19 processes, torchrun's agents
    # counted, on 16 cores); 07's two nodes among them (0.5: four processes more, Lightning's imports)
    two_ranks=dict(gpu=3.0, cpu=1), two_ranks_lightning=dict(gpu=0.5, cpu=0),
    # one start-up; compiling the model's forward and backward (0.5: 8 s on an H200,
    # results/1x-nvidia-h200-gpu-check/followup); 3 x 510 steps and the check, 2 s (0.5)
    step_forms=dict(gpu=2, cpu=4),  # on the CPU: compiling took 70 s on the 2-core VM, and 10 timed steps
    # collect_env (1.2), the loader's measurement (1), 01 (1), reading back the results and drawing the plots
    # (0.5: pandas and matplotlib)
    sweep=dict(gpu=3.7, cpu=4),  # on the CPU: --cpu 1 (a start-up there counted 30 s)
)
STEPS = ("warm up", "doctor", "gpu tests", "two ranks", "step forms", "sweep")
# Two ranks on one GPU: the pytest marker of those tests (tests/integration/test_gpu.py), a step of their own.
TWO_RANKS = "two_ranks"
# The first step: torch and torchvision imported once, and CUDA started, where the check runs on the GPU.
WARM_UP = """import sys, time
started = time.monotonic()
import torch, torchvision
if sys.argv[1] == "cuda":
    torch.cuda.init()  # the driver and CUDA's libraries: where they fail, the error says why
print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, CUDA available: "
      f"{torch.cuda.is_available()}; {time.monotonic() - started:.0f} s")"""


def bound_s(starts, kind):
    return int(math.ceil(MARGIN * starts * START_S[kind]))


def projected(cpu):
    """{step: (its work in seconds at the slowest start-up, its bound)}; Lightning's runs counted where it is."""
    kind = "cpu" if cpu else "gpu"
    work = {name: WORK[name.replace(" ", "_")][kind] for name in STEPS}
    if importlib.util.find_spec("lightning"):
        work["two ranks"] += WORK["two_ranks_lightning"][kind]
    return {name: (starts * START_S[kind], bound_s(starts, kind)) for name, starts in work.items()}


def worst_case_s(cpu):
    """How long the check can take whatever hangs: every bound, and every step cut with its grace."""
    return sum(bound for _, bound in projected(cpu).values()) + len(STEPS) * CUT_GRACE_S


def steps(work, cpu):
    """(name, argv, seconds at most) of each step (see WORK). The GPU tests run from tests/integration/test_gpu.py
    alone, which imports neither pandas nor matplotlib (a bare machine may lack them); with no pytest their steps
    are None."""
    python, bounds = sys.executable, {name: limit for name, (_, limit) in projected(cpu).items()}
    where = ["--cpu", "2"] if cpu else ["--gpus", "0"]
    has_pytest = importlib.util.find_spec("pytest") is not None

    def tests(name, selection):
        xml = f"{work}/{name.replace(' ', '-')}.xml"
        return ([python, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-m", selection,
                 "tests/integration/test_gpu.py", "--junitxml", xml] if has_pytest else None)

    sweep = (["--cpu", "1"] if cpu else ["--gpus", "0"]) + ["--modes", "01",
                                                           "--epoch-images", "1280" if cpu else "19200"]
    forms = ["--cpu", "--steps", "10"] if cpu else []  # on the 2-core VM, a step took 0.2-0.4 s
    planned = {
        "warm up": [python, "-c", WARM_UP, "cpu" if cpu else "cuda"],
        "doctor": [python, "bench/doctor.py", *where, "--quick", "--json", f"{work}/doctor.json",
                   "--logs", f"{work}/doctor"],
        "gpu tests": tests("gpu tests", f"gpu and not {TWO_RANKS}"),
        "two ranks": tests("two ranks", f"gpu and {TWO_RANKS}"),
        "step forms": [python, "-m", "bench.measure.step_forms", *forms, "--json", f"{work}/step-forms.json"],
        "sweep": [python, "bench/run_all.py", *sweep, "--synthetic", "--epochs", "1", "--timeout",
                  str(RUN_TIMEOUT_S["cpu" if cpu else "gpu"]), "--out", f"{work}/sweep"],
    }
    return [(name, planned[name], bounds[name]) for name in STEPS]


def test_counts(xml_path):
    """(tests, failed or errors, skipped) from pytest's junit XML, or None without a readable one."""
    try:
        suites = list(ElementTree.parse(xml_path).getroot().iter("testsuite"))
    except (OSError, ElementTree.ParseError):
        return None
    counts = [sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")]
    return counts[0], counts[1] + counts[2], counts[3]


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
    # A hung nvidia-smi or collect_env is given up on inside the step (machine.output_of), not cut with it.
    env = {STEP_MARK: mark, "BENCH_COMMAND_TIMEOUT_S": str(int(limit / MARGIN))}
    code, timed_out = run_processes([(env, argv)], [log], limit, grace=CUT_GRACE_S)
    left = end_leftovers(mark)
    status = f"TIMEOUT after {limit} s" if timed_out else "ok" if code == 0 else f"FAILED (exit code {code})"
    counts = test_counts(argv[argv.index("--junitxml") + 1]) if "--junitxml" in argv else None
    if counts:  # pytest's own exit status is 0 when every test skipped (no CUDA): that is no pass
        tests, failed, skipped = counts
        status = "skipped (every test skipped)" if code == 0 and tests == skipped else status
        status += f": {tests - failed - skipped} passed, {failed} failed, {skipped} skipped"
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
    work, failed, skipped = tempfile.mkdtemp(prefix="gpu-check-"), [], []
    os.makedirs(os.path.join(work, "doctor"))  # the doctor's --logs
    with open(os.path.join(args.out, "gpu-check.log"), "w") as report:
        planned = steps(work, args.cpu)
        report.write(f"== {len(planned)} steps, {sum(limit for *_, limit in planned)} s at most (each bound "
                     f"{MARGIN} x its projected work; a cut step has {CUT_GRACE_S} s more to end, "
                     f"{worst_case_s(args.cpu)} s if every step is cut)\n\n")
        for name, command, limit in planned:
            status, seconds, tail = run_step(name, command, limit, work)
            failed += [name] if not status.startswith(("ok", "skipped")) else []
            skipped += [name] if status.startswith("skipped") else []
            report.write(f"== {name}: {status} in {seconds:.0f} s (bound {limit} s)\n$ {' '.join(command or [])}\n"
                         f"{tail}\n\n")
            report.flush()
            print(f"{name}: {status} in {seconds:.0f} s", flush=True)
        verdict = "; ".join([f"FAILED: {', '.join(failed)}"] * bool(failed)
                            + [f"SKIPPED, not a pass: {', '.join(skipped)}"] * bool(skipped)) or "every step passed"
        report.write(f"== {verdict}\n")
    # What every step left, a cut one's too (its logs, the sweep's report and plots, the doctor's table and logs).
    with tarfile.open(os.path.join(args.out, "gpu-check.tgz"), "w:gz") as archive:
        archive.add(work, arcname="gpu-check", filter=lambda f: None if f.name.endswith(".pt") else f)
    print(f"{args.out}/gpu-check.log and gpu-check.tgz; {verdict}")
    return 1 if failed or skipped else 0


if __name__ == "__main__":
    sys.exit(main())
