"""Is this machine ready for multi-GPU training? Run this first on a new machine. One table checks the devices,
GPU memory, versions, topology, /dev/shm, ports, network settings, the all-reduce at each n of the sweep (its bus
bandwidth) and a short run of each mode at its largest n; each failure comes with its likely cause and fix.

    python bench/doctor.py                  # every GPU (or 2 CPU processes with gloo where there is none)
    python bench/doctor.py --gpus 0,1       # those GPUs (positions among the visible ones, as run_all.py takes)
    python bench/doctor.py --cpu 4          # 4 CPU processes over gloo, GPUs ignored
    python bench/doctor.py --quick          # without the short training run of each mode: under a minute
    python bench/doctor.py --json doctor.json

Exit status 0: ready (warnings allowed), 1: a check failed, 2: bad arguments, 130: interrupted.
"""
import argparse
import concurrent.futures
import contextlib
import glob
import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

if not __package__:  # `python bench/doctor.py`: the package is importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import REPO, checks, machine, measurements, outputs, plan, processes, sweep  # noqa: E402
from bench.flags import CPU_PROCESSES, BadArgument, Parser, add_devices, chosen_gpus  # noqa: E402
from bench.family import MODES  # noqa: E402

STEPS, BATCH, TRAIN_IMAGES, TEST_IMAGES = 6, 16, 2048, 100  # past the scripts' 5 warm-up steps; a tiny MNIST
AT_ONCE = 2  # training runs at a time on the CPU, each with half the cores
NCCL_SLOW_GB_S = 2  # the gradient's all-reduce on GPUs below this: not over NVLink or PCIe (a guess)
NCCL_REFERENCE = ("link peaks one way (NVIDIA datasheets): NVLink 4 (H100/H200 SXM) 450 GB/s, NVLink 3 (A100 SXM) "
                  "300, PCIe 5.0 x16 64, PCIe 4.0 x16 32; a 4.8 MB message reaches only a fraction of them")
SETTINGS_SHOWN = ("NCCL_", "GLOO_", "TORCH_DISTRIBUTED", "TORCH_NCCL", "MASTER_", "CUDA_VISIBLE_DEVICES",
                  "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS")
TINY_MNIST = ("import sys; from bench.fake_mnist import write_fake_mnist; "
              f"write_fake_mnist(sys.argv[1], {TRAIN_IMAGES}, {TEST_IMAGES})")
STARTED = time.monotonic()


def say(text):
    """Progress on stderr, with the seconds so far: stdout has the table alone."""
    print(f"doctor [{time.monotonic() - STARTED:3.0f} s]: {text}", file=sys.stderr, flush=True)


def row(check, status, detail, todo=""):
    return dict(check=check, status=status, detail=detail, todo=todo)


def parser():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_devices(p)
    p.add_argument("--quick", action="store_true", help="skip the training runs (then about 20 s)")
    p.add_argument("--json", metavar="PATH", help="the table as JSON")
    p.add_argument("--logs", metavar="FOLDER", help="keep the logs here (default: a folder kept if a check fails)")
    return p


def parse_args(argv):
    args = parser().parse_args(argv)
    if args.json and not writable(args.json):
        raise BadArgument(f"cannot write --json {args.json}: give a file in a folder that exists and is writable")
    if args.logs and not writable(os.path.join(args.logs, "doctor.json")):
        raise BadArgument(f"cannot write in --logs {args.logs}: give a folder that exists and is writable")
    return args


def writable(path):
    """Tried by writing beside it: os.access says yes to root on a read-only mount."""
    with contextlib.suppress(OSError):
        tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(path))).close()
        return not os.path.isdir(path)
    return False


def doctor_settings(gpus, args, work):
    """The sweep's settings (its GPUs, its n) for a tiny run of each mode: STEPS steps at the largest n."""
    max_n = len(gpus) or args.cpu or CPU_PROCESSES
    return plan.Settings(gpus=[i for i, _ in gpus], max_n=max_n, per_device_batches=[BATCH], epochs=1,
                         epoch_images=STEPS * BATCH * max_n, test_batch_size=TEST_IMAGES, seed=1, synthetic=False,
                         data_dir=os.path.join(work, "data"), target_acc=0.98, timeout=120,
                         cores=max(1, machine.cpu_cores() // (1 if gpus else AT_ONCE)))


def devices(gpus, settings, env):
    counts, torch = ", ".join(map(str, plan.device_counts(settings.max_n))), env.get("torch_version")
    if not gpus:
        cores = machine.cpu_cores()
        detail = f"no GPU used: the CPU ({env.get('cpu_model')}, {cores} cores), gloo at n = {counts}"
        return (row("devices", "warn", detail, f"{settings.max_n} processes on {cores} cores: each gets one thread "
                    "and runs are slower") if settings.max_n > cores else row("devices", "ok", detail))
    names = f"{len(gpus)} GPU(s) ({', '.join(f'{i}: {name}' for i, name in gpus)})"
    older = {i: c for i, c in checks.compute_capabilities(settings.gpus).items() if c < checks.OLDEST_CAPABILITY}
    old = "compute capability {}.{} (GPU {})".format(*min(older.values()), ", ".join(older)) if older else ""
    major, minor = checks.LAST_TORCH_FOR_OLDER
    pin = (f"torch {major}.{minor + 1} and later have no build for {old}: the last release that runs there is "
           f"{major}.{minor}, so pin torch<{major}.{minor + 1}")
    if old and (checks.release(torch) or (0, 0)) > (major, minor):
        return row("devices", "FAIL", f"{names}; but torch {torch} has no build for {old}", pin)
    if env.get("is_cuda_available") != "True":
        build = env.get("cuda_compiled_version") or "none, a CPU-only build"
        return row("devices", "FAIL", f"{names}; but torch {torch} cannot use CUDA (its CUDA: {build}; driver "
                   f"{env.get('nvidia_driver_version')})", "install a torch built for CUDA that this driver "
                   "supports (pytorch.org/get-started), or --cpu N" + (f"; {pin}" if old else ""))
    detail = f"{names}, NCCL at n = {counts}"
    return row("devices", "warn", f"{detail}; {old}", pin) if old else row("devices", "ok", detail)


def gpu_memory(ids):
    usage = checks.gpu_usage(ids) if ids else {}
    if not usage:
        return row("GPU memory", "skip", "n/a: " + ("nvidia-smi cannot tell" if ids else "no GPU used"))
    if held := checks.busy(usage):
        return row("GPU memory", "warn", "; ".join(held), "other processes slow the sweep and can run it out of "
                   "memory: stop them, or choose free GPUs with --gpus (CUDA_VISIBLE_DEVICES)")
    return row("GPU memory", "ok", "free: " + ", ".join(f"GPU {i} {u['memory_used_mib']} MiB used"
                                                        for i, u in usage.items()))


def versions(env):
    if "torch_error" in env:
        return row("versions", "FAIL", env["torch_error"], "pip install -r requirements.txt (the suite's versions)")
    lightning = next((d.version for d in importlib.metadata.distributions(name="lightning")),  # no import: seconds
                     "not installed (07 is left out)")
    cuda, runtime = env.get("cuda_compiled_version"), env.get("cuda_runtime_version")
    found = (f"torch {env.get('torch_version')}, torchvision {env.get('torchvision_version')}, lightning {lightning}, "
             f"CUDA {f'{cuda} build, runtime {runtime}' if cuda else 'none (CPU-only build)'}, driver "
             f"{env.get('nvidia_driver_version') or 'n/a'}, NCCL {env.get('nccl_version') or 'n/a (no CUDA here)'}, "
             f"Python {env.get('python_version', '').split()[0]}, {env.get('os')}")
    with open(os.path.join(REPO, "requirements.txt")) as f:  # the suite's oldest torch
        floor = next((line[len("torch>="):].strip() for line in f if line.startswith("torch>=")), None)
    have = checks.release(env.get("torch_version"))
    old = floor and have and have < checks.release(floor)  # 2.11's pipelining refused what 10 does
    return row("versions", "warn" if old else "ok", found, f"the suite needs torch {floor} or newer, and older "
               "releases fail in places: pip install -r requirements.txt" if old else "")


def topology(ids, env):
    links = checks.links(env.get("nvidia_smi_topo") or "", ids) if ids else {}
    if not links:
        return row("topology", "skip", "n/a: " + ("nvidia-smi topo -m gives no matrix" if ids else "no GPU used"))
    detail = ", ".join(f"{kind} x{count}" for kind, count in sorted(links.items())) + " (GPU pairs)"
    pcie = [kind for kind in links if not kind.startswith("NV")]
    return row("topology", "ok", detail + ("; NV# = NVLink" if len(pcie) < len(links) else ""),
               "some pairs talk over PCIe: if the collective hangs there, NCCL_P2P_DISABLE=1" if pcie else "")


def shared_memory():
    free = checks.shm_free_bytes()
    if free is None:
        return row("/dev/shm", "skip", "n/a: this OS has no /dev/shm")
    low = free < checks.SHM_LOW_BYTES
    return row("/dev/shm", "warn" if low else "ok", f"{free / 2**30:.1f} GiB free", "DataLoader workers and NCCL "
               "need more: docker run --shm-size=8g (or --ipc=host); docker's default is 64 MiB" if low else "")


def ports():
    default = int(os.environ.get("MASTER_PORT", checks.DEFAULT_PORT))
    detail = f"a free port found ({machine.free_port()}, the harness's way)"
    if checks.port_in_use(default):
        return row("ports", "warn", f"{detail}; port {default} (04's and 05's default, torchrun's) is in use",
                   "another job or a leftover process holds it: give the scripts --master-port PORT, or stop it")
    return row("ports", "ok", f"{detail}; port {default} (04's and 05's default) is free")


def settings_row():
    shown = {k: v for k, v in sorted(os.environ.items()) if k.startswith(SETTINGS_SHOWN)}
    detail = ", ".join(f"{k}={v}" for k, v in shown.items()) or "none of NCCL_*, GLOO_*, MASTER_* ... set"
    if missing := checks.missing_interfaces():
        return row("settings", "FAIL", f"{', '.join(missing)}: no such interface on this machine (set: {detail})",
                   f"unset it, or name one of this machine's interfaces: {', '.join(checks.interface_names())}")
    return row("settings", "ok", detail)


def gloo_reference(n):
    """gloo's bus bandwidth at n in the results committed, to compare with."""
    found = {os.path.basename(os.path.dirname(path)): result["gradient_row"]["busbw_gb_s"]
             for path in sorted(glob.glob(os.path.join(REPO, "results", "*", "allreduce*.json")))
             if (result := outputs.read_json(path) or {}).get("backend") == "gloo" and result.get("world_size") == n}
    return (f"gloo on loopback at n = {n}, the same size: {min(found.values()):.1f}-{max(found.values()):.1f} GB/s "
            f"(results/{', '.join(found)})" if found else "gloo on loopback: about 1 GB/s at n = 2 on a 2-core VM "
            "(results/); less with more processes per core")


def collective_rows(settings, work):
    """The all-reduce the harness runs before a sweep, at each n, bounded as there: (rows, the n where it failed)."""
    if settings.max_n < 2:
        return [row("all-reduce", "skip", "n/a: one device, the sweep needs no collective")], set()
    with contextlib.redirect_stdout(sys.stderr):  # its progress lines; the table goes to stdout
        results = measurements.measure_allreduce(settings, work)
    rows, backend = [], "gloo" if settings.cpu else "NCCL"
    for n, result in results.items():
        if "error" in result:  # measurements.run_tool has read the log: why, the cause's line, the fix
            rows.append(row(f"all-reduce n={n}", "FAIL", f"{backend}, {result['why']}: {result['cause']} (log "
                            f"{result['log']})", result["advice"]))
            continue
        largest = max(result["rows"], key=lambda r: r["bytes"])  # the gradient's size
        bandwidth, gradient_ms = largest["busbw_gb_s"], result["gradient_row"]["time_us"] / 1e3
        detail = (f"{result['backend']}: bus bandwidth {bandwidth:.2f} GB/s at {largest['bytes']:,} bytes (the "
                  f"gradient: {gradient_ms:.2f} ms); compare: {gloo_reference(n) if settings.cpu else NCCL_REFERENCE}")
        slow = not settings.cpu and bandwidth < NCCL_SLOW_GB_S
        rows.append(row(f"all-reduce n={n}", "warn" if slow else "ok", detail, "far below PCIe: NCCL_DEBUG=INFO "
                        "shows its transport (P2P, SHM or NET); a stale NCCL_P2P_DISABLE or NCCL_SHM_DISABLE forces "
                        "a slower one" if slow else ""))
    return rows, set(measurements.failed_collectives(results))


def largest_runs(settings):
    """Each available mode's run at the largest n it runs at; the modes left out, with why."""
    runs, _ = plan.plan(settings, list(MODES), [("base", [])], repeats=1)  # in increasing n: the largest stays
    return {run.mode: run for run in runs}, {m: why for m in MODES if (why := plan.unavailable_reason(m))}


def training_rows(settings, work, failed_n, rows=None):
    """One short run of each mode via sweep.run_one: AT_ONCE at a time on the CPU, one on GPUs. No collective mode
    starts after a timeout or where the all-reduce at its n failed. Rows go into rows in MODES' order."""
    largest, left_out = largest_runs(settings)
    rows, hung, at_once = [] if rows is None else rows, [], AT_ONCE if settings.cpu else 1  # a GPU run: all GPUs

    def train(mode):  # in the pool's threads, started in MODES' order
        check, run = f"train {MODES[mode].script[:2]} {mode}", largest.get(mode)
        if run is None:
            return row(check, "skip", f"{MODES[mode].script}: {left_out.get(mode, 'runs at no n here')}")
        if MODES[mode].collective and (run.n in failed_n or hung):
            why = f"the all-reduce at n={run.n} failed" if run.n in failed_n else f"{hung[0]} timed out"
            return row(check, "skip", f"n={run.n}: not run, {why} (fix that first)")
        say(f"{check} at n={run.n}")
        result = sweep.run_one(run, settings, work)
        if result["status"] == "ok":
            return row(check, "ok", f"n={run.n}: {result['samples_per_s'] or 0:,.0f} samples/s"
                       f"{f' ({at_once} runs at a time)' if at_once > 1 else ''}, {result['wall_s']:.0f} s")
        hung.extend([check] if result["status"] == "timeout" else [])
        text = f"{result['error']}\n{result['log_tail']}"
        return row(check, "FAIL", f"n={run.n}, {result['error']}: {checks.cause_line(text)} "
                   f"(log {os.path.join(work, result['log_path'])})", checks.advice(text))

    pool = concurrent.futures.ThreadPoolExecutor(at_once)
    try:
        for done in pool.map(train, MODES):
            rows.append(done)
    finally:  # after Ctrl-C or SIGTERM too: the runs under way stop, and their threads end
        processes.STOP.set()
        pool.shutdown(cancel_futures=True)
        processes.STOP.clear()
    return rows


def main(argv=None):
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        gpus = chosen_gpus(args)
    except BadArgument as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    work = args.logs or tempfile.mkdtemp(prefix="doctor-")
    for folder in ("logs", "metrics"):
        os.makedirs(os.path.join(work, folder), exist_ok=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # killed, it ends its runs as after Ctrl-C
    settings, rows, interrupted = doctor_settings(gpus, args, work), [], False
    mnist = None if args.quick else subprocess.Popen(  # in a child, while the other checks run: no torch here
        [sys.executable, "-c", TINY_MNIST, settings.data_dir], cwd=REPO, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        say("versions (torch's collect_env, in a child process)")
        env = machine.environment(REPO, gpus)
        rows += [devices(gpus, settings, env), gpu_memory(settings.gpus), versions(env),
                 topology(settings.gpus, env), shared_memory(), ports(), settings_row()]
        if rows[0]["status"] == "FAIL":  # the collective and the runs need devices that torch can use
            rows.append(row("all-reduce", "skip", "not run: torch cannot use these devices", "fix devices first"))
        else:
            say("the all-reduce at each n of the sweep")
            collective, failed_n = collective_rows(settings, work)
            rows += collective
            if mnist:
                _, error = mnist.communicate()
                if mnist.returncode == 0:
                    training_rows(settings, work, failed_n, rows)
                else:
                    rows.append(row("training runs", "FAIL", f"could not write a tiny MNIST: "
                                    f"{checks.cause_line(error)}", checks.advice(error)))
    except KeyboardInterrupt:  # run_processes has stopped the runs under way
        interrupted = True
        rows.append(row("interrupted", "FAIL", f"stopped after {time.monotonic() - STARTED:.0f} s, its runs "
                        "ended: the checks below the last row were not done", "run the doctor again"))
    finally:
        processes.stop([mnist] if mnist and mnist.poll() is None else [])
    failed = [r["check"] for r in rows if r["status"] == "FAIL"]
    elapsed = time.monotonic() - STARTED
    width = max(len(r["check"]) for r in rows)
    print(f"{'check':<{width}}  status  detail")
    for r in rows:
        print(f"{r['check']:<{width}}  {r['status']:<6}  {r['detail']}")
        if r["todo"]:  # what to do, on a line of its own
            print(" " * (width + 10) + f"-> {r['todo']}")
    print(f"NOT READY: {len(failed)} check(s) failed ({', '.join(failed)}); logs in {work}" if failed else
          f"READY for a sweep with the same --gpus/--cpu ({sum(r['status'] == 'warn' for r in rows)} warning(s))",
          f" [{elapsed:.0f} s]")
    if not (failed or args.logs):
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        outputs.write_json(args.json, dict(ready=not failed, elapsed_s=round(elapsed, 1), rows=rows,
                                           logs=work if failed or args.logs else None, interrupted=interrupted))
    return 130 if interrupted else 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
