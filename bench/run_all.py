"""Benchmark every parallelism mode of this suite over 1..n GPUs (or CPU processes): tables and plots.

    python bench/run_all.py --gpus 0,1,2,3            # GPUs 0-3: n = 1, 2, 4, every mode, real MNIST in ./data
    python bench/run_all.py                           # every GPU; on a CPU-only machine 1 and 2 processes (gloo)
    python bench/run_all.py --synthetic --per-gpu-batch 64,512 --repeats 3   # two batches, medians of 3
    python bench/run_all.py --dry-run                 # print the runs and an estimate of the time; run nothing
    python bench/run_all.py --gpus 0,1 --resume       # continue a sweep that was stopped (Ctrl-C, crash)
    CUDA_VISIBLE_DEVICES=4,5,6,7 python bench/run_all.py   # those four GPUs; --gpus then counts within them

For each n (1, the powers of two below the number of devices, then that number) it runs every mode that
applies, each started as a user would start it (bench/commands.py: 01 gets --batch-size B, 02 n x B, every
other mode B in each of n processes). Defaults: on GPUs 3 full epochs; on the CPU 1 epoch of at most 150
steps. Before the runs it measures the input pipeline alone and, for n >= 2, the all-reduce of the model's
gradient (bench/measure/). Writes under --out (default results/<machine>): runs.csv, summary.csv, env.json,
report.md, four PNG plots, logs/ and metrics/. Exit status: 0 when every run finished, 1 when any failed,
2 for bad arguments (nothing is run), 130 after Ctrl-C (rerun with --resume).
"""
import argparse
import os
import shlex
import signal
import sys

if not __package__:  # `python bench/run_all.py`: the package is importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import machine, plan, runner  # noqa: E402
from bench.commands import commands, for_scripts, shown  # noqa: E402
from bench.fake_mnist import missing_mnist_files  # noqa: E402
from bench.files import read_json, write_json  # noqa: E402
from bench.scripts import MODES, REPO, SCRIPTS  # noqa: E402

DEFAULT_CPU_PROCESSES = 2
DEFAULTS = dict(gpu=dict(epochs=3, max_steps=0), cpu=dict(epochs=1, max_steps=150))
VARIANTS = {"amp": ["--amp"], "compile": ["--compile"], "amp+compile": ["--amp", "--compile"]}


class BadArgument(Exception):
    """Bad input: one line on stderr and exit 2, before anything runs."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage block would hide the one line that matters
        raise BadArgument(message)


def at_least(low, kind=int):
    def number(text):
        value = kind(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value
    number.__name__ = kind.__name__  # argparse names it in "invalid int value"
    return number


def int_list(text):
    """Distinct non-negative integers, comma-separated: "0,1,2" or "64,512"."""
    values = [int(v) for v in text.split(",")]
    if len(set(values)) != len(values) or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected distinct numbers such as 0,1,2, got {text!r}")
    return values


def mode_list(text):
    """Modes by name or by number (01..07), in reading order whatever order they were given in."""
    by_number = {script[:2]: mode for mode, script in SCRIPTS.items()}
    modes = {by_number.get(m.strip(), m.strip()) for m in text.split(",") if m.strip()}
    if not modes or modes - set(MODES):
        raise argparse.ArgumentTypeError(f"unknown mode {', '.join(sorted(modes - set(MODES))) or repr(text)}: "
                                         f"choose from {', '.join(MODES)} (or 01..07)")
    return [m for m in MODES if m in modes]


def variant_names(text):
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))  # in order, once each
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variant {', '.join(unknown)}: choose from {', '.join(VARIANTS)}, "
                                         "or give any flags with --variant NAME=\"FLAGS\"")
    return [(n, VARIANTS[n]) for n in names]


def variant(text):
    name, sep, flags = text.partition("=")
    if not sep or not name.isidentifier() or name in ("base", *VARIANTS):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=\"FLAGS\" with a new name of letters, digits, _")
    return name, shlex.split(flags)


def parse_args(argv):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--gpus", type=int_list, help="GPUs by position among those visible, e.g. 0,1,2,3 "
                                                     "(default: every GPU; under CUDA_VISIBLE_DEVICES, its GPUs)")
    where.add_argument("--cpu", type=at_least(1), metavar="N", help=f"ignore GPUs: 1..N CPU processes "
                                                                    f"(default {DEFAULT_CPU_PROCESSES} without GPUs)")
    p.add_argument("--per-gpu-batch", type=int_list, default=[64], metavar="B,...",
                   help="batch per GPU/process; a list sweeps each (default 64)")
    p.add_argument("--epochs", type=at_least(1), help="epochs per run (default: 3 on GPUs, 1 on the CPU)")
    p.add_argument("--max-steps", type=at_least(0), help="steps per epoch, 0: all (default: 0 on GPUs, 150 on the CPU)")
    p.add_argument("--test-batch-size", type=at_least(1), default=1000)
    p.add_argument("--seed", type=int, default=1, help="seed of repeat 1; repeat k uses seed + k - 1")
    p.add_argument("--repeats", type=at_least(1), default=1, metavar="K", help="runs per row; tables show medians")
    p.add_argument("--modes", type=mode_list, default=MODES, help=f"comma-separated from {', '.join(MODES)} or 01..07")
    p.add_argument("--synthetic", action="store_true", help="random MNIST-shaped data: throughput only, no download")
    p.add_argument("--data-dir", default="data", help="torchvision's MNIST folder (default ./data)")
    p.add_argument("--no-download", action="store_true", help="stop if MNIST is not in --data-dir")
    p.add_argument("--target-acc", type=at_least(0.0, float), default=0.98, help="for time to accuracy (default 0.98)")
    p.add_argument("--timeout", type=at_least(1.0, float), default=600, help="seconds before a run is killed (600)")
    p.add_argument("--variants", type=variant_names, default=[], metavar="NAME,...",
                   help=f"repeat the sweep once per variant, from {', '.join(VARIANTS)}")
    p.add_argument("--variant", type=variant, action="append", default=[], metavar='NAME="FLAGS"',
                   help="repeat the sweep with these script flags (repeatable), e.g. lr2=\"--lr 2\"")
    p.add_argument("--out", help="output folder (default results/<machine>)")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="keep the ok runs already in --out and do the rest")
    again.add_argument("--force", action="store_true", help="replace the results already in --out")
    p.add_argument("--dry-run", action="store_true", help="print the planned runs and their rough duration only")
    args = p.parse_args(argv)
    names = [name for name, _ in args.variant]
    if len(set(names)) != len(names):
        raise BadArgument(f"--variant: each name once, got {', '.join(names)}")
    return args


def choose_gpus(args):
    """[(id, name)] of the GPUs to sweep ([] on the CPU): --gpus positions among the visible ones."""
    if args.cpu is not None:
        return []
    visible = machine.gpus()
    if args.gpus is None:
        return visible
    absent = [i for i in args.gpus if i >= len(visible)]
    if absent:
        raise BadArgument(f"GPU {', '.join(map(str, absent))} does not exist: {len(visible)} GPU(s) visible"
                          + (f" ({', '.join(i for i, _ in visible)})" if visible else "; use --cpu N for the CPU"))
    return [visible[i] for i in args.gpus]


def check_out(path, resume, force):
    """Prove the folder can be made and written before anything is downloaded or run (nothing is created yet)."""
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise BadArgument(f"cannot create output folder {path}: {existing} is not a writable folder")
    if os.path.exists(os.path.join(path, "runs.csv")) and not (resume or force):
        raise BadArgument(f"{path} already holds a sweep: --resume continues it, --force replaces it, "
                          "--out chooses another folder")


def earlier_runs(out_dir, settings):
    """The ok rows of an earlier attempt at the same sweep, by key, for --resume."""
    if not os.path.exists(os.path.join(out_dir, "runs.csv")):
        return {}
    earlier = read_json(os.path.join(out_dir, "env.json"), {}).get("settings")
    if earlier != settings.comparable():
        diff = sorted(k for k in earlier or {} if earlier[k] != settings.comparable().get(k)) or ["env.json unreadable"]
        raise BadArgument(f"cannot --resume {out_dir}: it was run with other settings ({', '.join(diff)})")
    return {(r["variant"], r["mode"], int(r["n"]), int(r["batch"]), int(r["repeat"])): r
            for r in runner.read_runs(out_dir) if r["status"] == "ok"}


def prepare_data(settings, download):
    """Real MNIST must be there before the sweep: one download here rather than a race inside every run."""
    raw = os.path.join(settings.data_dir, "MNIST", "raw")
    if settings.synthetic or not missing_mnist_files(os.path.join(REPO, settings.data_dir)):
        return
    if not download:
        raise BadArgument(f"MNIST is not in {raw} (--no-download): put the four idx files there or pass --synthetic")
    print(f"MNIST is not in {raw}: downloading it once before the sweep", flush=True)
    try:
        from torchvision import datasets
        for train in (True, False):
            datasets.MNIST(os.path.join(REPO, settings.data_dir), train=train, download=True)
    except Exception as e:
        raise BadArgument(f"MNIST is not in {raw} and could not be downloaded ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                          "put the four idx files there or pass --synthetic for throughput only")


def print_plan(runs, done, settings, left_out):
    todo = [r for r in runs if r.key not in done]
    total = sum(plan.estimate_s(r, settings) for r in todo) + 15 * (settings.max_n > 1) + 10
    print(f"{len(runs)} runs planned, {len(runs) - len(todo)} already done (--resume), {len(todo)} to do; "
          f"roughly {total / 60:.0f} min (a guess before anything ran)", flush=True)
    for run in todo:
        print(f"  {run.run_id}: {shown(commands(run, settings, 'metrics.json', 'snapshot.pt'), settings.cpu)}")
    for mode, n, why in left_out:
        print(f"  left out: {SCRIPTS[mode]}" + (f" at n = {n}" if n else "") + f" ({why})")


def interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "bench/run_all.py"] + argv)
    try:
        args = parse_args(argv)
        gpus = choose_gpus(args)
        kind = "gpu" if gpus else "cpu"
        settings = plan.Settings(
            gpus=[i for i, _ in gpus], cpu_processes=args.cpu or DEFAULT_CPU_PROCESSES, batches=args.per_gpu_batch,
            epochs=args.epochs or DEFAULTS[kind]["epochs"], test_batch_size=args.test_batch_size,
            max_steps=DEFAULTS[kind]["max_steps"] if args.max_steps is None else args.max_steps, seed=args.seed,
            synthetic=args.synthetic, data_dir=for_scripts(args.data_dir), target_acc=args.target_acc,
            timeout=args.timeout, cores=machine.cpu_cores())
        modes = [m for m in args.modes if not plan.unavailable(m)]
        left_out = [(m, None, plan.unavailable(m)) for m in args.modes if m not in modes] + plan.left_out(settings, modes)
        runs = plan.plan(settings, modes, [("base", [])] + args.variants + args.variant, args.repeats)
        if not runs:
            raise BadArgument("nothing to run: " + "; ".join(f"{SCRIPTS[m]}: {why}" for m, _, why in left_out))
        out_dir = os.path.abspath(args.out or os.path.join(REPO, "results", machine.machine_tag([n for _, n in gpus])))
        check_out(out_dir, args.resume, args.force)
        done = earlier_runs(out_dir, settings) if args.resume else {}
        print_plan(runs, done, settings, left_out)
        if args.dry_run:
            return 0
        prepare_data(settings, not args.no_download)
        for sub in ("logs", "metrics"):
            os.makedirs(os.path.join(out_dir, sub), exist_ok=True)
    except BadArgument as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the folder could still fail to be made (a full disk, a race): one line too
        print(f"error: cannot create output folder {out_dir}: {e.strerror}", file=sys.stderr)
        return 2

    env = dict(machine.environment(REPO, gpus), python=sys.executable, harness_command=command,
               hardware=machine.hardware_label([n for _, n in gpus], settings.cpu_processes),
               settings=settings.comparable())
    earlier = read_json(os.path.join(out_dir, "env.json"), {}) if args.resume else {}
    # A resumed sweep keeps the figures measured when it started: the same machine, and seconds saved.
    env["loader"] = earlier.get("loader") or runner.loader_figure(settings, out_dir)
    env["allreduce"] = earlier.get("allreduce") or runner.allreduce_figures(settings, out_dir)
    for n, figure in env["allreduce"].items():
        grad = figure.get("gradient_row")
        print(f"all-reduce of the gradient at n={n}: " + (f"{grad['time_us'] / 1e3:.2f} ms" if grad
                                                        else f"not measured ({figure['error']})"), flush=True)
    write_json(os.path.join(out_dir, "env.json"), env)
    signal.signal(signal.SIGTERM, interrupt)  # a killed harness stops its runs too, as Ctrl-C does
    print(f"benchmarking on {env['hardware']} -> {out_dir}", flush=True)
    try:
        runner.write_runs(out_dir, runner.run_plan(runs, done, settings, out_dir))
        from bench import plots, report  # seconds to import: not before the arguments are checked
        frame = report.read_runs(out_dir)
        summary = report.write_summary(out_dir, frame)
        written = plots.write_all(out_dir, summary, env["hardware"], settings)
        report.write_report(out_dir, frame, summary, env, settings, left_out, written, command)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the finished runs are in {out_dir}/runs.csv; add --resume to continue", file=sys.stderr)
        return 130
    failed = frame[frame["status"] != "ok"]
    print(f"done: {len(frame) - len(failed)} of {len(frame)} runs ok; report {os.path.join(out_dir, 'report.md')}")
    for _, row in failed.iterrows():
        print(f"FAILED {row['run_id']}: {row['error']} (log {os.path.join(out_dir, row['log_path'])})", file=sys.stderr)
    return 1 if len(failed) else 0


if __name__ == "__main__":
    sys.exit(main())
