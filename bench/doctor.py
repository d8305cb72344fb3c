"""Is this machine ready for multi-GPU training? Run this first on a new machine: one table, each failure with its
likely cause and fix. --quick takes under a minute. The short run of each mode, two at a time on the CPU, took
67-69 s in all on a quiet 2-core VM (85 s one at a time).

    python bench/doctor.py                  # every GPU (or 2 CPU processes with gloo where there is none)
    python bench/doctor.py --gpus 0,1       # those GPUs (positions among the visible ones, as run_all.py takes)
    python bench/doctor.py --cpu 4          # 4 CPU processes over gloo, GPUs ignored
    python bench/doctor.py --quick          # without the short training run of each mode
    python bench/doctor.py --json doctor.json

It checks the devices (GPUs that other processes hold, GPUs too old for newer torch releases), the versions
(driver, CUDA, NCCL, torch), the topology, /dev/shm, ports, the network interface settings, the all-reduce at each
n the sweep uses (NCCL on GPUs, gloo on the CPU) with its bus bandwidth, and one short training run of each mode at
the largest n it runs at.
Exit status 0: ready (warnings allowed), 1: a check failed, 2: bad arguments. The checks themselves are in
bench/checks.py; the harness uses them too.
"""
import argparse
import concurrent.futures
import contextlib
import importlib.metadata
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

if not __package__:  # `python bench/doctor.py`: the package is importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import checks, machine, measurements, plan, processes, sweep  # noqa: E402
from bench.outputs import read_json, write_json  # noqa: E402
from bench.flags import CPU_PROCESSES, BadArgument, Parser, add_devices, chosen_gpus  # noqa: E402
from bench.family import MODES, REPO  # noqa: E402

# A handful of steps past the scripts' 5 warm-up ones, on a tiny MNIST written for the doctor: evaluating 10,000
# test images would be most of each run's time (30 s instead of 10 s on a 2-core VM).
STEPS, BATCH, TRAIN_IMAGES, TEST_IMAGES = 6, 16, 2048, 100
RUN_TIMEOUT_S = 120  # such a run takes 10-40 s on a busy 2-core VM
AT_ONCE = 2  # training runs at a time on the CPU, each with half the cores
NCCL_SLOW_GB_S = 2  # the gradient's all-reduce below this on GPUs: not over NVLink or PCIe (a guess, see reference)
FAKE_MNIST = "import sys; from bench.fake_mnist import write_fake_mnist; write_fake_mnist(sys.argv[1], {}, {})"
# Links' one-way peaks from NVIDIA's datasheets; nccl-tests' busbw nears them only for messages of hundreds of MB.
NCCL_REFERENCE = ("link peaks one way (NVIDIA datasheets): NVLink 4 (H100/H200 SXM) 450 GB/s, NVLink 3 (A100 SXM) "
                  "300, PCIe 5.0 x16 64, PCIe 4.0 x16 32; a 4.8 MB message reaches only a fraction of them")
SETTINGS_SHOWN = ("NCCL_", "GLOO_", "TORCH_DISTRIBUTED", "TORCH_NCCL", "MASTER_", "CUDA_VISIBLE_DEVICES",
                  "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS")
STARTED = time.monotonic()


def say(text):
    """Progress on stderr, with the seconds so far: the table alone goes to stdout."""
    print(f"doctor [{time.monotonic() - STARTED:3.0f} s]: {text}", file=sys.stderr, flush=True)


def row(check, status, detail, todo=""):
    return dict(check=check, status=status, detail=detail, todo=todo)


def parser():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_devices(p)
    p.add_argument("--quick", action="store_true", help="skip the training runs (then about 20 s)")
    p.add_argument("--json", metavar="PATH", help="the table as JSON")
    p.add_argument("--logs", metavar="FOLDER", help="the runs' logs and metrics go here and stay (default: a "
                   "temporary folder, kept only when a check fails)")
    return p


def parse_args(argv):
    args = parser().parse_args(argv)
    if args.json and not writable(args.json):
        raise BadArgument(f"cannot write --json {args.json}: give a file in a folder that exists and is writable")
    if args.logs and not (os.path.isdir(args.logs) and writable(os.path.join(args.logs, "doctor.json"))):
        raise BadArgument(f"cannot write in --logs {args.logs}: give a folder that exists and is writable")
    return args


def writable(path):
    """Tried by writing beside it, as the harness tries --out (os.access says yes to root on a read-only mount)."""
    try:
        tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.abspath(path))).close()
    except OSError:
        return False
    return not os.path.isdir(path)


def doctor_settings(gpus, args, work):
    """The sweep's settings (its GPUs, its n) with a tiny run of each mode: tiny MNIST in the doctor's folder.
    An epoch of STEPS global batches at the largest n (plan.steps_per_epoch): STEPS steps there, more below."""
    max_n = len(gpus) or args.cpu or CPU_PROCESSES
    return plan.Settings(
        gpus=[i for i, _ in gpus], max_n=max_n, per_device_batches=[BATCH], epochs=1,
        epoch_images=STEPS * BATCH * max_n,
        test_batch_size=TEST_IMAGES, seed=1, synthetic=False, data_dir=os.path.join(work, "data"),
        target_acc=0.98, timeout=RUN_TIMEOUT_S, cores=max(1, machine.cpu_cores() // (1 if gpus else AT_ONCE)))


def start_tiny_mnist(data_dir):
    """Written by a child process (torch must not load here), in the background while the other checks run."""
    code = FAKE_MNIST.format(TRAIN_IMAGES, TEST_IMAGES)
    return subprocess.Popen([sys.executable, "-c", code, data_dir], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def devices(gpus, settings, env):
    counts = ", ".join(map(str, plan.device_counts(settings.max_n)))
    if not gpus:
        cores, todo = machine.cpu_cores(), ""
        detail = f"no GPU used: the CPU ({env.get('cpu_model')}, {cores} cores), gloo at n = {counts}"
        if settings.max_n > cores:
            todo = f"{settings.max_n} processes on {cores} cores: each gets one thread and runs are slower"
        return row("devices", "warn" if todo else "ok", detail, todo)
    names = ", ".join(f"{i}: {name}" for i, name in gpus)
    old, last = older_gpus(settings.gpus), checks.LAST_TORCH_FOR_OLDER
    pin = (f"torch {last[0]}.{last[1] + 1} and later have no build for {old}: the last release that runs there is "
           f"{last[0]}.{last[1]}, so pin torch<{last[0]}.{last[1] + 1}")
    if old and (checks.release(env.get("torch_version")) or (0, 0)) > last:
        return row("devices", "FAIL", f"{names}; but torch {env.get('torch_version')} has no build for {old}", pin)
    if env.get("is_cuda_available") != "True":
        build = env.get("cuda_compiled_version") or "none, a CPU-only build"
        return row("devices", "FAIL", f"{names}; but torch {env.get('torch_version')} cannot use CUDA "
                   f"(its CUDA: {build}; driver {env.get('nvidia_driver_version')})",
                   "install a torch built for CUDA that this driver supports (pytorch.org/get-started), or --cpu N"
                   + (f"; {pin}" if old else ""))
    if old:  # this torch runs there; an upgrade would not
        return row("devices", "warn", f"{len(gpus)} GPU(s) ({names}), NCCL at n = {counts}; {old}", pin)
    return row("devices", "ok", f"{len(gpus)} GPU(s) ({names}), NCCL at n = {counts}")


def older_gpus(ids):
    """The GPUs among ids below the compute capability torch's newer releases are built for, as "compute
    capability 7.0 (GPU 0, 1)" (the lowest); "" where there are none, or nvidia-smi cannot tell."""
    older = {i: c for i, c in checks.compute_capabilities(ids).items() if c < checks.OLDEST_CAPABILITY}
    if not older:
        return ""
    lowest = min(older.values())
    return f"compute capability {lowest[0]}.{lowest[1]} (GPU {', '.join(older)})"


def gpu_memory(ids):
    if not ids:
        return row("GPU memory", "skip", "n/a: no GPU used")
    usage = checks.gpu_usage(ids)
    if not usage:
        return row("GPU memory", "skip", "n/a: nvidia-smi cannot tell")
    held = checks.busy(usage)
    if held:
        return row("GPU memory", "warn", "; ".join(held),
                   "other processes slow the sweep and can run it out of memory: stop them, or choose free GPUs "
                   "with --gpus (CUDA_VISIBLE_DEVICES)")
    return row("GPU memory", "ok", "free: " + ", ".join(f"GPU {i} {u['memory_used_mib']} MiB used"
                                                        for i, u in usage.items()))


def version_of(package):
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(package)  # without importing it: lightning takes seconds
    return None


def versions(env):
    if "torch_error" in env:
        return row("versions", "FAIL", env["torch_error"], "pip install -r requirements.txt (the suite's versions)")
    cuda, runtime = env.get("cuda_compiled_version"), env.get("cuda_runtime_version")
    found = [f"torch {env.get('torch_version')}", f"torchvision {env.get('torchvision_version')}",
             f"lightning {version_of('lightning') or 'not installed (07 is left out)'}",
             f"CUDA {f'{cuda} build, runtime {runtime}' if cuda else 'none (CPU-only build)'}",
             f"driver {env.get('nvidia_driver_version') or 'n/a'}",
             f"NCCL {env.get('nccl_version') or 'n/a (no CUDA here)'}",
             f"Python {env.get('python_version', '').split()[0]}", f"{env.get('os')}"]
    with open(os.path.join(REPO, "requirements.txt")) as f:  # the suite's oldest torch
        floor = re.search(r"^torch>=([\d.]+)", f.read(), re.M)
    have = release(env.get("torch_version") or "")
    if floor and have and have < release(floor.group(1)):  # 2.11's pipelining, say, refused what 10 once did
        return row("versions", "warn", ", ".join(found), f"the suite needs torch {floor.group(1)} or newer, and "
                   "older releases fail in places: pip install -r requirements.txt")
    return row("versions", "ok", ", ".join(found))


def release(version):
    """(major, minor) of a version such as 2.11.0+cu130."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def topology(ids, env):
    if not ids:
        return row("topology", "skip", "n/a: no GPU used")
    links = checks.links(env.get("nvidia_smi_topo") or "", ids)
    if not links:
        return row("topology", "skip", "n/a: nvidia-smi topo -m gives no matrix", "")
    detail = ", ".join(f"{kind} x{count}" for kind, count in sorted(links.items())) + " (GPU pairs)"
    pcie = [kind for kind in links if not kind.startswith("NV")]
    return row("topology", "ok", detail + ("; NV# = NVLink" if len(pcie) < len(links) else ""),
               "some pairs talk over PCIe: if the collective hangs there, NCCL_P2P_DISABLE=1" if pcie else "")


def shared_memory():
    free = checks.shm_free_bytes()
    if free is None:
        return row("/dev/shm", "skip", "n/a: this OS has no /dev/shm")
    detail = f"{free / 2**30:.1f} GiB free"
    if free < checks.SHM_LOW_BYTES:
        return row("/dev/shm", "warn", detail, "DataLoader workers and NCCL need more: docker run --shm-size=8g "
                   "(or --ipc=host); docker's default is 64 MiB")
    return row("/dev/shm", "ok", detail)


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
    missing = checks.missing_interfaces()
    if missing:
        return row("settings", "FAIL", f"{', '.join(missing)}: no such interface on this machine (set: {detail})",
                   f"unset it, or name one of this machine's interfaces: {', '.join(checks.interface_names())}")
    return row("settings", "ok", detail)


def reference(backend, n):
    """What to compare the bus bandwidth with: the gloo figures committed in results/, NCCL's links' peaks."""
    if backend != "gloo":
        return NCCL_REFERENCE
    found, results = {}, os.path.join(REPO, "results")
    for name in sorted(os.listdir(results) if os.path.isdir(results) else []):
        for path in (os.path.join(results, name, f) for f in ("allreduce.json", f"allreduce-n{n}.json")):
            result = read_json(path) or {}
            if result.get("backend") == "gloo" and result.get("world_size") == n:
                found[name] = result["gradient_row"]["busbw_gb_s"]
    if not found:
        return "gloo on loopback: about 1 GB/s at n = 2 on a 2-core VM (results/); less with more processes per core"
    low, high = min(found.values()), max(found.values())
    return f"gloo on loopback at n = {n}, the same size: {low:.1f}-{high:.1f} GB/s (results/{', '.join(found)})"


def collective_rows(settings, work):
    """The all-reduce the harness runs before a sweep, at each n, as it runs it (and bounded as it is): the rows,
    and the n where it failed."""
    backend = "gloo" if settings.cpu else "NCCL"
    if settings.max_n < 2:
        return [row("all-reduce", "skip", "n/a: one device, the sweep needs no collective")], set()
    with contextlib.redirect_stdout(sys.stderr):  # its progress lines; the table goes to stdout
        results = measurements.measure_allreduce(settings, work)
    rows = [collective_failed(n, result, backend) if "error" in result else collective_ok(n, result, backend)
            for n, result in results.items()]
    return rows, {n for n, result in results.items() if "error" in result}


def collective_failed(n, result, backend):
    """measurements.run_tool has read the log: why, the line naming the cause, and the fix."""
    return row(f"all-reduce n={n}", "FAIL", f"{backend}, {result['why']}: {result['cause']} (log {result['log']})",
               result["advice"])


def collective_ok(n, result, backend):
    """Bus bandwidth at the largest size it ran (the gradient's), beside a reference for this backend."""
    largest = max(result["rows"], key=lambda r: r["bytes"])
    bandwidth, gradient_ms = largest["busbw_gb_s"], result["gradient_row"]["time_us"] / 1e3
    detail = (f"{result['backend']}: bus bandwidth {bandwidth:.2f} GB/s at {largest['bytes']:,} bytes (the "
              f"gradient: {gradient_ms:.2f} ms); compare: {reference(backend.lower(), n)}")
    if backend == "NCCL" and bandwidth < NCCL_SLOW_GB_S:
        return row(f"all-reduce n={n}", "warn", detail, "far below PCIe: NCCL_DEBUG=INFO shows its transport (P2P, "
                   "SHM or NET); a stale NCCL_P2P_DISABLE or NCCL_SHM_DISABLE forces a slower one")
    return row(f"all-reduce n={n}", "ok", detail)


def largest_runs(settings):
    """Each available mode's run at the largest n it runs at; the modes left out, with why."""
    runs, _ = plan.plan(settings, list(MODES), [("base", [])], repeats=1)
    largest = {}
    for run in runs:
        largest[run.mode] = run  # runs come in increasing n
    return largest, {m: plan.unavailable_reason(m) for m in MODES if plan.unavailable_reason(m)}


def training_rows(settings, work, failed_n, rows=None):
    """One short run of each mode through the harness's own run_one, AT_ONCE at a time on the CPU (a short run
    waits mostly on its start-up); none that needs a collective known broken, nor one started after a timeout.
    Each row goes into rows (a new list if None), in MODES' order, once it and the rows before it are done."""
    largest, left_out = largest_runs(settings)
    rows, hung, done, running, order = [] if rows is None else rows, [], {}, {}, list(MODES)
    at_once = AT_ONCE if settings.cpu else 1  # on GPUs a run has every GPU the doctor checks

    def finish(future):
        (mode, check, run), result = running.pop(future), future.result()
        done[mode] = training_row(check, run, result, work, at_once)
        hung.extend([check] if result["status"] == "timeout" else [])

    def flush():
        while order and order[0] in done:
            rows.append(done[order.pop(0)])

    pool = concurrent.futures.ThreadPoolExecutor(at_once)
    try:
        for mode in MODES:
            while len(running) >= at_once:  # a place for this run: one under way ends first
                finish(next(iter(concurrent.futures.wait(running, return_when="FIRST_COMPLETED")[0])))
                flush()
            check, run = f"train {MODES[mode].script[:2]} {mode}", largest.get(mode)
            if run is None:
                done[mode] = row(check, "skip", f"{MODES[mode].script}: {left_out.get(mode, 'runs at no n here')}")
            elif MODES[mode].collective and (run.n in failed_n or hung):
                why = f"the all-reduce at n={run.n} failed" if run.n in failed_n else f"{hung[0]} timed out"
                done[mode] = row(check, "skip", f"n={run.n}: not run, {why} (fix that first)")
            else:
                say(f"{check} at n={run.n}")
                running[pool.submit(sweep.run_one, run, settings, work)] = (mode, check, run)
            flush()
        for future in concurrent.futures.as_completed(list(running)):
            finish(future)
        flush()
    except KeyboardInterrupt:  # the runs under way end as after Ctrl-C, then the doctor says so
        processes.STOP.set()
        raise
    finally:
        pool.shutdown()  # once the runs under way have ended
        processes.STOP.clear()
    return rows


def training_row(check, run, result, work, at_once=1):
    if result["status"] == "ok":
        beside = f" ({at_once} runs at a time)" if at_once > 1 else ""
        return row(check, "ok", f"n={run.n}: {result['samples_per_s'] or 0:,.0f} samples/s{beside}, "
                   f"{result['wall_s']:.0f} s")
    text = f"{result['error']}\n{result['log_tail']}"
    return row(check, "FAIL", f"n={run.n}, {result['error']}: {checks.cause_line(text)} "
               f"(log {os.path.join(work, result['log_path'])})", checks.advice(text))


def table(rows):
    """check, status, detail; what to do on a line of its own below, where there is something to do."""
    width = max(len(r["check"]) for r in rows)
    lines = [f"{'check':<{width}}  status  detail"]
    for r in rows:
        lines.append(f"{r['check']:<{width}}  {r['status']:<6}  {r['detail']}")
        lines += [f"{'':<{width}}  {'':<6}  -> {r['todo']}"] if r["todo"] else []
    return "\n".join(lines)


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
    # Killed (a bound such as the GPU check's, `kill`), it ends its runs as after Ctrl-C: they run in sessions of
    # their own, which a signal to the doctor's process group does not reach, and could hold the GPUs for the next.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    rows, interrupted = [], False
    try:
        checked(args, gpus, doctor_settings(gpus, args, work), work, rows)
    except KeyboardInterrupt:  # run_processes has stopped the run under way on the way here
        interrupted = True
        rows.append(row("interrupted", "FAIL", f"stopped after {time.monotonic() - STARTED:.0f} s, its runs "
                        "ended: the checks below the last row were not done", "run the doctor again"))
    failed = [r["check"] for r in rows if r["status"] == "FAIL"]
    elapsed = time.monotonic() - STARTED
    print(table(rows))
    if failed:
        print(f"NOT READY: {len(failed)} check(s) failed ({', '.join(failed)}); logs in {work}  [{elapsed:.0f} s]")
    else:
        if not args.logs:
            shutil.rmtree(work, ignore_errors=True)
        warned = sum(r["status"] == "warn" for r in rows)
        print(f"READY for a sweep with the same --gpus/--cpu{f' ({warned} warning(s) above)' if warned else ''}"
              f"  [{elapsed:.0f} s]")
    if args.json:
        write_json(args.json, dict(ready=not failed, elapsed_s=round(elapsed, 1), rows=rows,
                                   logs=work if failed or args.logs else None, interrupted=interrupted))
    return 130 if interrupted else 1 if failed else 0


def checked(args, gpus, settings, work, rows):
    """Every check's row in order, into rows as it goes (an interrupted doctor shows those done); the collective
    and the runs only where torch can use the devices."""
    mnist = None if args.quick else start_tiny_mnist(settings.data_dir)  # meanwhile: ~5 s of torch's import
    try:
        say("versions (torch's collect_env, in a child process)")
        env = machine.environment(REPO, gpus)
        rows += [devices(gpus, settings, env), gpu_memory(settings.gpus), versions(env),
                 topology(settings.gpus, env), shared_memory(), ports(), settings_row()]
        if rows[0]["status"] == "FAIL":
            rows.append(row("all-reduce", "skip", "not run: torch cannot use these devices", "fix devices first"))
            return
        say("the all-reduce at each n of the sweep")
        collective, failed_n = collective_rows(settings, work)
        rows += collective
        if mnist:
            _, error = mnist.communicate()
            if mnist.returncode == 0:
                training_rows(settings, work, failed_n, rows)
            else:
                rows.append(row("training runs", "FAIL", f"could not write a tiny MNIST: {checks.cause_line(error)}",
                                checks.advice(error)))
    finally:
        if mnist and mnist.poll() is None:
            mnist.kill()
            mnist.wait()


if __name__ == "__main__":
    sys.exit(main())
