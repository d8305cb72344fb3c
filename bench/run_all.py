"""Benchmark every parallelism mode of this suite over 1..n GPUs (or CPU processes) and write tables and plots.

    python bench/run_all.py --gpus 0,1,2,3            # GPUs 0-3: n = 1, 2, 4, every mode, real MNIST in ./data
    python bench/run_all.py                           # all GPUs; on a CPU-only machine: 1 and 2 processes (gloo)
    python bench/run_all.py --synthetic               # random data, no download: throughput only
    python bench/run_all.py --cpu 2 --synthetic --max-steps 20 --out /tmp/smoke   # a quick smoke test
    python bench/run_all.py --gpus 0,1 --resume       # continue a sweep that was stopped (Ctrl-C, crash)

For each n (1, the powers of two below the number of devices, then that number) it runs every mode that
applies, each exactly as a user would start it, with CUDA_VISIBLE_DEVICES choosing the GPUs and a free port
each time:
    01  python 01_single_gpu.py --batch-size B                                     (n = 1)
    02  python 02_data_parallel.py --gpus 0,..,n-1 --batch-size n*B               (on the CPU: n = 1, no --gpus)
    03  torchrun --standalone --nproc_per_node n 03_ddp_launch.py --batch-size B
    04  python 04_ddp_spawn.py --nprocs n --master-port P --batch-size B
    05  python 05_multinode_mnist.py -n 2 -g n/2 --nr R --master-addr 127.0.0.1 --master-port P --batch-size B
        twice at once (R = 0, 1): two "nodes" on this host                        (n even)
B is --per-gpu-batch, so every multi-device mode has the global batch n*B. Without GPUs (or with --cpu N)
the same sweep runs on the CPU with n = 1..N processes and the gloo backend.

Without --synthetic the runs train on real MNIST from --data-dir, which is downloaded once before the
sweep when missing; if it cannot be, the harness stops with one line (it never falls back to random data).
Defaults: on GPUs 3 full epochs; on the CPU 1 epoch of at most 150 steps per run (the whole default CPU
sweep, 7 runs, took 2 min 34 s on a quiet 2-core VM).

Writes under --out (default results/<machine tag>): runs.csv (one row per run, failed ones too), summary.csv
(medians per mode and n, speed-up and scaling efficiency E(n) = X(n) / (n X(01))), env.json (with the input
pipeline's own speed from bench/loader_speed.py, also in loader_speed.json, and the all-reduce times below),
four PNG plots, report.md, logs/<run-id>.log and metrics/<run-id>.json. Exit status: 0 when every run
finished, 1 when any failed, 2 for bad arguments (nothing is run), 130 after Ctrl-C (rerun with --resume).

Before the runs, for every n >= 2, bench/allreduce.py times the all-reduce of the model's gradient with the
sweep's backend (a few seconds per n; env.json "allreduce", also allreduce-n<N>.json; a failure is noted
and the sweep goes on). report.md sets every DDP and DataParallel run against the limit that this
all-reduce and 01's own step time allow.

Variants: --variants amp,compile adds the whole sweep again with --amp, and again with --compile, given to
every script (names: amp, compile, amp+compile); --variant NAME="FLAGS" adds one with any flags (e.g.
--variant lr2="--lr 2"). report.md compares each variant with the base sweep, per mode and n. The
environment variable BENCH_EXTRA_ARGS adds flags to every run and BENCH_EXTRA_ARGS_<MODE> (e.g.
BENCH_EXTRA_ARGS_DDP_SPAWN="--timeout 60") to one mode's runs; both are recorded in each run's command and
in env.json.
"""
import argparse
import os
import shlex
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling modules, from any working directory

import allreduce  # noqa: E402
import envinfo  # noqa: E402
import loader_speed  # noqa: E402
import sweep  # noqa: E402
from fake_mnist import missing_mnist_files  # noqa: E402
from files import read_json, write_csv, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALIASES = {"01": "single", "02": "dp", "03": "ddp_launch", "04": "ddp_spawn", "05": "ddp_multinode"}
DEFAULT_CPU_PROCESSES = 2
DEFAULTS = dict(gpu=dict(epochs=3, max_steps=0), cpu=dict(epochs=1, max_steps=150))
# --variants NAME,...: the one place that maps a variant's name to the script flags it adds.
VARIANTS = {"amp": ["--amp"], "compile": ["--compile"], "amp+compile": ["--amp", "--compile"]}


class BadArgument(Exception):
    """Bad input: one line on stderr and exit 2, before anything runs."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage block would hide the one line that matters
        raise BadArgument(message)


def parse_args(argv):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", help="comma-separated GPU ids as CUDA_VISIBLE_DEVICES / nvidia-smi number them "
                                  "(default: every GPU; none on a CPU-only machine)")
    p.add_argument("--cpu", type=int, metavar="N", help=f"ignore GPUs: run on the CPU with 1..N processes "
                                                       f"(default {DEFAULT_CPU_PROCESSES} when there is no GPU)")
    p.add_argument("--per-gpu-batch", type=int, default=64, metavar="B", help="batch per GPU/process (default 64)")
    p.add_argument("--epochs", type=int, help="epochs per run (default: 3 on GPUs, 1 on the CPU)")
    p.add_argument("--max-steps", type=int, help="training steps per epoch, 0 for whole epochs "
                                                 "(default: 0 on GPUs, 150 on the CPU)")
    p.add_argument("--test-batch-size", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1, help="seed of repeat 1; repeat k uses seed + k - 1")
    p.add_argument("--repeats", type=int, default=1, metavar="K", help="runs per mode and n; tables show medians")
    p.add_argument("--modes", default=",".join(sweep.MODES),
                   help=f"comma-separated, from {', '.join(sweep.MODES)} (or 01..05); default all")
    p.add_argument("--synthetic", action="store_true", help="random MNIST-shaped data: throughput only, no download")
    p.add_argument("--data-dir", default="data", help="torchvision's MNIST folder (default ./data)")
    p.add_argument("--no-download", action="store_true", help="stop if MNIST is not in --data-dir instead of downloading it")
    p.add_argument("--target-acc", type=float, default=0.98, help="test accuracy for time to accuracy (default 0.98)")
    p.add_argument("--timeout", type=float, default=600, help="seconds before a run is killed (default 600)")
    p.add_argument("--variants", default="", metavar="NAME,...",
                   help=f"repeat the sweep once per named variant, from {', '.join(VARIANTS)}")
    p.add_argument("--variant", action="append", default=[], metavar='NAME="FLAGS"',
                   help="repeat the sweep with these extra script flags (repeatable)")
    p.add_argument("--out", help="output folder (default results/<machine tag>)")
    p.add_argument("--resume", action="store_true", help="keep the ok runs already in --out/runs.csv and do the rest")
    p.add_argument("--force", action="store_true", help="replace the results already in --out")
    return p.parse_args(argv)


def parse_modes(text):
    modes = [ALIASES.get(m.strip(), m.strip()) for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in sweep.SCRIPTS]
    if unknown or not modes:
        raise BadArgument(f"unknown mode {', '.join(unknown) or repr(text)}: choose from {', '.join(sweep.MODES)}")
    missing = [sweep.SCRIPTS[m] for m in modes if not os.path.exists(os.path.join(REPO, sweep.SCRIPTS[m]))]
    if missing:
        raise BadArgument(f"{', '.join(missing)} not found in {REPO}: leave that mode out with --modes")
    return [m for m in sweep.MODES if m in modes]  # reading order, whatever order was given


def parse_variants(specs, names=""):
    """[(name, script flags)]: the base sweep, then --variants' named ones, then each --variant NAME="FLAGS"."""
    variants = [("base", [])] + [(name, VARIANTS[name]) for name in known_variants(names)]
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name.isidentifier() or name == "base" or name in dict(variants):
            raise BadArgument(f"--variant {spec!r}: expected NAME=\"FLAGS\" with a new name made of letters, digits and _")
        variants.append((name, shlex.split(flags)))
    return variants


def known_variants(text):
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))  # in order, once each
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise BadArgument(f"unknown variant {', '.join(unknown)}: choose from {', '.join(VARIANTS)}, "
                          f"or give any flags with --variant NAME=\"FLAGS\"")
    return names


def choose_devices(args):
    """(GPU ids, CPU processes, names of the GPUs used)."""
    if args.cpu is not None and args.gpus is not None:
        raise BadArgument("give either --gpus or --cpu, not both")
    if args.cpu is not None:
        if args.cpu < 1:
            raise BadArgument(f"--cpu must be at least 1 process, got {args.cpu}")
        return [], args.cpu, []
    gpus = {g[0]: g[1] for g in envinfo.gpus()}
    if args.gpus is None:
        return list(gpus), DEFAULT_CPU_PROCESSES, list(gpus.values())
    ids = [i.strip() for i in args.gpus.split(",")]
    if not all(i.isdigit() for i in ids) or len(set(ids)) != len(ids):
        raise BadArgument(f"--gpus {args.gpus!r}: expected distinct GPU ids such as 0,1,2,3")
    absent = [i for i in ids if i not in gpus]
    if absent:
        raise BadArgument(f"GPU {', '.join(absent)} does not exist: this machine has {len(gpus)} GPU(s)"
                          + (f" ({', '.join(gpus)})" if gpus else "; use --cpu N to benchmark the CPU"))
    return ids, DEFAULT_CPU_PROCESSES, [gpus[i] for i in ids]


def check_numbers(args):
    for name, low in (("per_gpu_batch", 1), ("repeats", 1), ("test_batch_size", 1), ("epochs", 1), ("max_steps", 0)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise BadArgument(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
    if not 0 < args.target_acc <= 1:
        raise BadArgument(f"--target-acc is a fraction in (0, 1], got {args.target_acc}")
    if args.timeout <= 0:
        raise BadArgument(f"--timeout must be positive, got {args.timeout}")
    if args.resume and args.force:
        raise BadArgument("give either --resume or --force, not both")


def check_out(path, resume, force):
    """Prove the folder can be made and written before anything is downloaded or run (nothing is created yet)."""
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise BadArgument(f"cannot create output folder {path}: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BadArgument(f"cannot write to output folder {path}: {existing} is not writable")
    if os.path.exists(os.path.join(path, "runs.csv")) and not (resume or force):
        raise BadArgument(f"{path} already holds a sweep: --resume continues it, --force replaces it, --out chooses another folder")


def make_out(path):
    for sub in ("logs", "metrics"):
        os.makedirs(os.path.join(path, sub), exist_ok=True)


def prepare_data(settings, download):
    """Real MNIST must be there before the sweep: one download here rather than a race inside every run."""
    if settings.synthetic:
        return
    raw = os.path.join(settings.data_dir, "MNIST", "raw")
    if not missing_mnist_files(settings.data_dir):
        return
    if not download:
        raise BadArgument(f"MNIST is not in {raw} (--no-download): put the four idx files there or pass --synthetic")
    print(f"MNIST is not in {raw}: downloading it once before the sweep", flush=True)
    import contextlib
    import io
    try:
        from torchvision import datasets
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for train in (True, False):
                datasets.MNIST(settings.data_dir, train=train, download=True)
    except Exception as e:
        reason = (str(e).splitlines()[0].rstrip(": ") if str(e) else "") or type(e).__name__
        raise BadArgument(f"MNIST is not in {raw} and could not be downloaded ({reason}); "
                          "put the four idx files there or pass --synthetic for throughput only")


def settings_from(args, devices, cpu_processes):
    defaults = DEFAULTS["gpu" if devices else "cpu"]
    return sweep.Settings(
        devices=devices, cpu_processes=cpu_processes, per_gpu_batch=args.per_gpu_batch,
        epochs=args.epochs if args.epochs is not None else defaults["epochs"],
        max_steps=args.max_steps if args.max_steps is not None else defaults["max_steps"],
        test_batch_size=args.test_batch_size, seed=args.seed, synthetic=args.synthetic,
        data_dir=sweep._for_scripts(args.data_dir, REPO), target_acc=args.target_acc, timeout=args.timeout,
        cores=envinfo.cpu_cores())


def load_done(out_dir, settings, resume):
    """The ok rows of an earlier attempt at the same sweep, keyed by (variant, mode, n, repeat)."""
    import pandas as pd
    if not resume or not os.path.exists(os.path.join(out_dir, "runs.csv")):
        return {}
    earlier = read_json(os.path.join(out_dir, "env.json"), {}).get("settings")
    if earlier is None:
        raise BadArgument(f"cannot --resume: {out_dir}/env.json is missing or unreadable")
    if earlier != settings.comparable():
        diff = sorted(k for k in earlier if earlier.get(k) != settings.comparable().get(k))
        raise BadArgument(f"cannot --resume {out_dir}: it was run with other settings ({', '.join(diff)})")
    rows = pd.read_csv(os.path.join(out_dir, "runs.csv"), keep_default_na=False, na_values=[""]).to_dict("records")
    return {(r["variant"], r["mode"], int(r["n"]), int(r["repeat"])): r for r in rows if r["status"] == "ok"}


def write_tables(out_dir, rows):
    """runs.csv, then summary.csv from it (read back so the columns have their CSV types)."""
    import pandas as pd
    frame = pd.DataFrame(rows, columns=sweep.COLUMNS)
    write_csv(os.path.join(out_dir, "runs.csv"), frame)
    return pd.read_csv(os.path.join(out_dir, "runs.csv"), keep_default_na=False, na_values=[""])


def clock(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def run_sweep(runs, done, settings, out_dir):
    """Run what is not done yet; runs.csv is rewritten after every run so that a stop loses at most one."""
    t0, walls, todo, by_key = time.monotonic(), [], [r for r in runs if r.key not in done], {}
    print(f"{len(runs)} runs planned, {len(runs) - len(todo)} already done (--resume), {len(todo)} to do", flush=True)
    for i, run in enumerate(todo, 1):
        unit = "GPUs" if not settings.cpu else "processes"
        tag = f"[{i}/{len(todo)}] {run.mode} n={run.n} ({unit})" + (f" repeat {run.repeat}" if run.repeat > 1 else "") \
            + ("" if run.variant == "base" else f" variant {run.variant}")
        print(f"{tag}: start, elapsed {clock(time.monotonic() - t0)}{_eta(walls, len(todo) - i + 1)}", flush=True)
        row = sweep.perform(run, settings, REPO, out_dir)
        walls.append(row["wall_s"])
        by_key[run.key] = row
        write_tables(out_dir, _rows(runs, done, by_key))
        result = (_measured(row) if row["status"] == "ok" else f"{row['error']}, log {os.path.join(out_dir, row['log_path'])}")
        print(f"{tag}: {row['status']} in {row['wall_s']:.1f} s, {result}; elapsed {clock(time.monotonic() - t0)}"
              f"{_eta(walls, len(todo) - i)}", flush=True)
    return _rows(runs, done, by_key)


def _rows(runs, done, fresh):
    """runs.csv in plan order; ok runs of an earlier attempt outside this plan (other --modes) are kept."""
    planned = {r.key for r in runs}
    return ([fresh.get(r.key) or done[r.key] for r in runs if r.key in fresh or r.key in done]
            + [row for key, row in done.items() if key not in planned])


def _measured(row):
    speed, acc = row.get("samples_per_s"), row.get("test_accuracy")
    return (f"{speed:,.0f} samples/s" if speed is not None else "no steady-state throughput") + \
        (f", accuracy {acc:.2%}" if acc is not None else "")


def _eta(walls, left):
    if not walls or not left:
        return "" if walls or not left else ", time left unknown"
    return f", about {clock(sum(walls) / len(walls) * left)} left"


def finish(out_dir, rows, settings, env, runs_skipped, command):
    """summary.csv, plots, report.md: regenerated from runs.csv, also after a partial or failed sweep."""
    import plots
    import report
    frame = write_tables(out_dir, rows)
    summary = report.write_summary(out_dir, frame)
    plots.write_all(out_dir, summary, env["hardware"], settings)
    report.write_report(out_dir, frame, summary, env, settings, runs_skipped, command)
    return frame


def measure_allreduce(settings, out_dir):
    """t_ar(n) for report.md's limit model, measured before the runs so that nothing else shares the devices."""
    figures = allreduce.sweep_figures(settings, REPO, out_dir)
    for n, figure in figures.items():
        grad = figure.get("gradient_row")
        print(f"all-reduce of the gradient at n={n}: " + (f"{grad['time_us'] / 1e3:.2f} ms ({figure['backend']})"
                                                        if grad else f"not measured ({figure['error']})"), flush=True)
    return figures


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "bench/run_all.py"] + argv)
    try:
        args = parse_args(argv)
        check_numbers(args)
        modes = parse_modes(args.modes)
        variants = parse_variants(args.variant, args.variants)
        devices, cpu_processes, gpu_names = choose_devices(args)
        settings = settings_from(args, devices, cpu_processes)
        out_dir = os.path.abspath(args.out or os.path.join(REPO, "results", envinfo.machine_tag(gpu_names, cpu_processes)))
        check_out(out_dir, args.resume, args.force)
        done = load_done(out_dir, settings, args.resume)
        prepare_data(settings, not args.no_download)
        make_out(out_dir)
    except BadArgument as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the folder could still fail to be made (a full disk, a race): say so in one line
        print(f"error: cannot create output folder {out_dir}: {e.strerror}", file=sys.stderr)
        return 2

    runs = sweep.plan(settings, modes, variants, args.repeats)
    env = dict(envinfo.collect(REPO, devices), hardware=envinfo.hardware_label(gpu_names, cpu_processes),
               harness_command=command, settings=settings.comparable(),
               extra_args={k: v for k, v in os.environ.items() if k.startswith(sweep.EXTRA_ARGS_ENV)})
    # A resumed sweep keeps the figures measured when it started: the same machine, and seconds saved.
    earlier = read_json(os.path.join(out_dir, "env.json"), {}) if args.resume else {}
    env["loader"] = earlier.get("loader") or loader_speed.sweep_figure(settings, REPO, out_dir)  # vs 01, in report.md
    env["allreduce"] = earlier.get("allreduce") or (
        measure_allreduce(settings, out_dir) if set(modes) - {"single"} else {})
    write_json(os.path.join(out_dir, "env.json"), env)
    signal.signal(signal.SIGTERM, _interrupt)  # a killed harness stops its runs too, as Ctrl-C does
    print(f"benchmarking on {env['hardware']} -> {out_dir}", flush=True)
    try:
        rows = run_sweep(runs, done, settings, out_dir)
        frame = finish(out_dir, rows, settings, env, sweep.skipped(settings, modes), command)
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
