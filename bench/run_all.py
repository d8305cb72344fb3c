"""Benchmark every parallelism mode of this suite over 1..n GPUs (or CPU processes): tables and plots.

    python bench/run_all.py --gpus 0,1,2,3            # GPUs 0-3: n = 1, 2, 4, every mode, real MNIST in ./data
    python bench/run_all.py                           # every GPU; on a CPU-only machine 1 and 2 processes (gloo)
    python bench/run_all.py --synthetic --per-gpu-batch 64,512 --repeats 3   # two batches, medians of 3
    python bench/run_all.py --dry-run                 # the planned runs and a rough duration; nothing is run
    python bench/run_all.py --gpus 0,1 --resume       # continue a sweep that was stopped (Ctrl-C, crash)
    CUDA_VISIBLE_DEVICES=4,5,6,7 python bench/run_all.py   # those four GPUs; --gpus then counts within them

n: 1, the powers of two below the number of devices, that number. Writes report.md, plots, runs.csv and more under
--out. Exit status 0: every run ok, 1: some failed, 2: bad arguments (nothing run), 130: Ctrl-C (then --resume).
"""
import argparse
import contextlib
import os
import shlex
import signal
import sys
import tempfile

if not __package__:  # `python bench/run_all.py`: the package is importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import REPO, fake_mnist, machine, measurements, plan, processes, sweep  # noqa: E402
from bench.commands import as_typed, commands, repo_relative  # noqa: E402
from bench.flags import (CPU_PROCESSES, BadArgument, Parser, add_devices, chosen_gpus,  # noqa: E402
                         in_range, in_range_list, mode_list, variant)
from bench.outputs import read_json, read_runs, write_json, write_runs  # noqa: E402
from bench.family import MODES  # noqa: E402

RESULTS = os.path.join(REPO, "results")  # each machine's sweeps: results/<label>, then <label>-2, -3...

# On the CPU 3 short epochs of 19,200 images: every mode passes 98% on real MNIST by the 2nd or 3rd.
# On GPUs a run's steady window can be under a second, and one try of 01's step moved 29% from the next: each
# row is the median of 3 runs there, with their spread beside it.
DEFAULTS = dict(gpu=dict(epochs=3, epoch_images=0, repeats=3),
                cpu=dict(epochs=3, epoch_images=19200, processes=CPU_PROCESSES, repeats=1))


def parser():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu, cpu = DEFAULTS["gpu"], DEFAULTS["cpu"]
    add_devices(p)
    p.add_argument("--per-gpu-batch", type=in_range_list(1), default=[64], metavar="B,...", dest="per_device_batches",
                   help="the batch of each device (GPU or CPU process); each is swept (default 64)")
    p.add_argument("--epochs", type=in_range(1),
                   help=f"epochs per run (default: {gpu['epochs']} on GPUs, {cpu['epochs']} on the CPU)")
    p.add_argument("--epoch-images", type=in_range(0), metavar="N",
                   help="training images per epoch at every n: N / the global batch steps (the scripts' --max-steps); "
                   f"0: all 60,000 (default: {gpu['epoch_images'] or 'all'} on GPUs, {cpu['epoch_images']:,} on CPU)")
    p.add_argument("--test-batch-size", type=in_range(1), default=1000)
    p.add_argument("--seed", type=in_range(0, 2**32 - 1000), default=1,  # the scripts take seeds below 2**32
                   help="seed of repeat 1; repeat k uses seed + k - 1")
    p.add_argument("--repeats", type=in_range(1), metavar="K",
                   help=f"runs per row; tables show medians and spreads (default {gpu['repeats']} on GPUs, "
                   f"{cpu['repeats']} on the CPU)")
    p.add_argument("--modes", type=mode_list, default=list(MODES), help=f"from {', '.join(MODES)}, or numbers (01,03)")
    p.add_argument("--synthetic", action="store_true", help="random MNIST-shaped data: throughput only, no download")
    p.add_argument("--data-dir", default="data", help="torchvision's MNIST folder (default ./data)")
    p.add_argument("--no-download", action="store_true", help="stop if MNIST is not in --data-dir")
    p.add_argument("--target-acc", type=in_range(0.0, 1.0, kind=float), default=0.98,
                   help="for time to accuracy (0.98)")
    p.add_argument("--timeout", type=in_range(1.0, kind=float),
                   help="seconds before a run is killed (default: 5 x its estimate + 120)")
    p.add_argument("--variant", type=variant, action="append", default=[], metavar='NAME="FLAGS"',
                   help="repeat the sweep with these script flags (repeatable), e.g. lr2=\"--lr 2\"")
    p.add_argument("--out", help="output folder (default results/<machine>, or -2, -3... if that holds a sweep)")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="keep the ok runs already in --out, do the rest")
    again.add_argument("--force", action="store_true", help="replace the results already in --out")
    p.add_argument("--anatomy", action="store_true", help="then profile 3 steps of each mode at the largest n: "
                   "what it moves, where its time goes (bench/anatomy.py), in the report")
    p.add_argument("--dry-run", action="store_true", help="print the planned runs and a rough duration only")
    return p


def parse_args(argv):
    args = parser().parse_args(argv)
    args.variants = list(dict(args.variant).items())  # each name once, in order
    return args


def check_out(path, resume, force):
    """Before anything runs, write as the first write will: a temporary file in the folder, or the nearest above."""
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    try:
        tempfile.NamedTemporaryFile(dir=existing).close()
    except OSError as e:
        raise BadArgument(f"cannot create output folder {path}: cannot write in {existing} ({e.strerror})")
    if os.path.exists(os.path.join(path, "runs.csv")) and not (resume or force):
        raise BadArgument(f"{path} holds a sweep: --resume continues it, --force replaces it, --out goes elsewhere")


def default_out(label, resume):
    """The first of results/<label>, <label>-2, -3... that holds no sweep; with --resume, the last that holds one."""
    folders = [os.path.join(RESULTS, label)]
    while os.path.exists(os.path.join(folders[-1], "runs.csv")):
        folders.append(os.path.join(RESULTS, f"{label}-{len(folders) + 1}"))
    return folders[-2] if resume and len(folders) > 1 else folders[-1]


def check_no_stray_runs(out_dir):
    """Runs of a sweep killed outright still use its devices; their command lines name its metrics/ folder."""
    strays = {pid: command for folder in (out_dir, repo_relative(out_dir))
              for pid, command in processes.processes_mentioning(os.path.join(folder, "metrics", ""))}
    if strays:
        named = "; ".join(f"pid {pid}: {command[:80]}" for pid, command in strays.items())
        raise BadArgument(f"runs of an earlier sweep into {out_dir} are still running ({named}): stop them first")


def download_mnist(data_dir, allowed):
    """Once before the sweep, rather than once in every run."""
    raw = os.path.join(data_dir, "MNIST", "raw")
    if allowed:
        print(f"MNIST is not in {raw}: downloading it once before the sweep", flush=True)
        try:
            from torchvision import datasets
            return [datasets.MNIST(os.path.join(REPO, data_dir), train=train, download=True) for train in (1, 0)]
        except Exception as e:
            raw += f" and could not be downloaded ({type(e).__name__})"
    raise BadArgument(f"MNIST is not in {raw}: put the four idx files there, or use --synthetic for throughput only")


def print_plan(runs, done, settings, left_out, out_dir):
    todo = [r for r in runs if r.run_id not in done]
    minutes = (sum(plan.estimate_s(r, settings) for r in todo) + 10 + 15 * (settings.max_n > 1)) / 60
    print(f"{len(runs)} runs planned, {len(runs) - len(todo)} already done (--resume), {len(todo)} to do; "
          f"roughly {minutes:.0f} min on {plan.ESTIMATED_ON[settings.kind]} (a guess before "
          f"anything ran; after each run, the time left at this machine's pace); results in {out_dir}", flush=True)
    for run in todo:
        print(f"  {run.run_id}: {as_typed(commands(run, settings, 'metrics.json', 'snapshot.pt'), settings.cpu)}")
    print("".join(f"  left out: {line}\n" for line in left_out), end="")


def write_report(out_dir, env, settings, left_out):
    """summary.csv, the plots and report.md from runs.csv; the runs' frame."""
    from bench import plots, report  # seconds to import: not before the arguments are checked
    frame, summary = report.read_and_summarize(out_dir)
    written = plots.write_all(out_dir, summary, env["hardware"], settings)
    report.write_report(out_dir, frame, summary, env, settings, left_out, written)
    return frame


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "bench/run_all.py"] + argv)
    try:
        args = parse_args(argv)
        gpus = chosen_gpus(args)
        defaults = DEFAULTS["gpu" if gpus else "cpu"]
        settings = plan.Settings(
            gpus=[i for i, _ in gpus], max_n=len(gpus) or args.cpu or defaults["processes"],
            per_device_batches=args.per_device_batches, epochs=args.epochs or defaults["epochs"],
            epoch_images=defaults["epoch_images"] if args.epoch_images is None else args.epoch_images, seed=args.seed,
            test_batch_size=args.test_batch_size, synthetic=args.synthetic, data_dir=repo_relative(args.data_dir),
            target_acc=args.target_acc, timeout=args.timeout, cores=machine.cpu_cores())
        runs, left_out = plan.plan(settings, args.modes, [("base", [])] + args.variants,
                                    args.repeats or defaults["repeats"])
        if not runs:
            raise BadArgument("nothing to run: " + "; ".join(left_out))
        out_dir = os.path.abspath(args.out or default_out(machine.machine_tag([n for _, n in gpus]), args.resume))
        check_out(out_dir, args.resume, args.force or args.dry_run)  # a dry run writes nothing: it never refuses
        if not args.dry_run:
            check_no_stray_runs(out_dir)  # before --resume reads what they may still be writing
        earlier = read_json(os.path.join(out_dir, "env.json"), {}) if args.resume else {}
        done = {}  # with --resume, the ok runs of a sweep run with these settings
        if args.resume and os.path.exists(os.path.join(out_dir, "runs.csv")):
            diff = sorted(k for k, v in settings.comparable().items() if (earlier.get("settings") or {}).get(k) != v)
            if diff:
                raise BadArgument(f"cannot --resume {out_dir}: it was run with other settings ({', '.join(diff)})")
            done = {r["run_id"]: r for r in read_runs(out_dir) if r["status"] == "ok"}
        print_plan(runs, done, settings, left_out, out_dir)
        if args.dry_run:
            return 0
        if not settings.synthetic and fake_mnist.missing_mnist_files(os.path.join(REPO, settings.data_dir)):
            download_mnist(settings.data_dir, not args.no_download)
    except BadArgument as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    for folder in ("logs", "metrics"):
        os.makedirs(os.path.join(out_dir, folder), exist_ok=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # killed, it stops its runs as after Ctrl-C
    try:
        env = dict(machine.environment(REPO, gpus), python=sys.executable, harness_command=command,
                   hardware=machine.hardware_label([n for _, n in gpus], settings.max_n),
                   settings=settings.comparable())
        print(f"benchmarking on {env['hardware']} -> {out_dir}", flush=True)
        # A resumed sweep keeps what was measured when it started (the same machine), but retries a failed collective.
        env["loader"] = earlier.get("loader") or measurements.measure_loader(settings, out_dir)
        env["allreduce"] = earlier.get("allreduce")
        if not env["allreduce"] or measurements.failed_collectives(env["allreduce"]):
            env["allreduce"] = measurements.measure_allreduce(settings, out_dir)
        write_json(os.path.join(out_dir, "env.json"), env)
        broken = measurements.failed_collectives(env["allreduce"])
        write_runs(out_dir, sweep.run_plan(runs, done, settings, out_dir, broken))
        if args.anatomy:  # after the sweep, which it would slow down
            from bench import anatomy
            env["anatomy"], failed = anatomy.sweep([m for m in args.modes if not plan.unavailable_reason(m)],
                                                   settings, out_dir)
            left_out += failed
            write_json(os.path.join(out_dir, "env.json"), env)
        frame = write_report(out_dir, env, settings, left_out)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the finished runs are in {out_dir}/runs.csv; add --resume to continue", file=sys.stderr)
        # A report of the runs that finished, the others named as not run; a second Ctrl-C gives it up.
        if os.path.exists(os.path.join(out_dir, "runs.csv")) and os.path.exists(os.path.join(out_dir, "env.json")):
            with contextlib.suppress(KeyboardInterrupt):
                finished = {r["run_id"] for r in read_runs(out_dir)}
                not_run = [f"{r.run_id} (not run: the sweep was interrupted; --resume runs it)" for r in runs
                           if r.run_id not in finished]
                write_report(out_dir, read_json(os.path.join(out_dir, "env.json")), settings, left_out + not_run)
                print(f"report of the finished runs: {os.path.join(out_dir, 'report.md')}", file=sys.stderr)
        return 130
    failed = frame[frame["status"] != "ok"]["run_id"]
    print(f"done: {len(frame) - len(failed)} of {len(frame)} runs ok; report {os.path.join(out_dir, 'report.md')}")
    if len(failed):
        print(f"FAILED: {', '.join(failed)} (see report.md)", file=sys.stderr)
    return 1 if len(failed) else 0


if __name__ == "__main__":
    sys.exit(main())
