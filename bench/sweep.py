"""The sweep: which runs, the exact command of each, running them safely, and the row each one leaves.

A run is keyed by (variant, mode, n, repeat). Each is started as a user would start it, in its own process
group so that a timeout or Ctrl-C can stop it and every child it spawned (torchrun workers, spawn children).
"""
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone

# mode -> script; the order is the reading order of the tutorial and of every table.
SCRIPTS = {
    "single": "01_single_gpu.py",
    "dp": "02_data_parallel.py",
    "ddp_launch": "03_ddp_launch.py",
    "ddp_spawn": "04_ddp_spawn.py",
    "ddp_multinode": "05_multinode_mnist.py",
}
MODES = list(SCRIPTS)
EXTRA_ARGS_ENV = "BENCH_EXTRA_ARGS"  # + "_<MODE>" for one mode; see run_all.py's docstring
KILL_GRACE_S = 5  # SIGTERM first so that process groups can be destroyed cleanly, then SIGKILL
PEER_GRACE_S = 15  # once one node of 05 has failed, the other would only wait for its rendezvous timeout
LOG_TAIL_LINES = 15


@dataclasses.dataclass
class Settings:
    """Everything that decides what a run does; stored in env.json so that --resume can check it."""
    devices: list  # GPU ids (strings) or, on the CPU, [] with cpu_processes set
    cpu_processes: int
    per_gpu_batch: int
    epochs: int
    max_steps: int
    test_batch_size: int
    seed: int
    synthetic: bool
    data_dir: str
    target_acc: float
    timeout: float
    cores: int  # CPU runs share them: each of n processes gets cores // n threads

    @property
    def cpu(self):
        return not self.devices

    @property
    def max_n(self):
        return self.cpu_processes if self.cpu else len(self.devices)

    def comparable(self):
        """The settings that change results: a resumed sweep must match them."""
        d = dataclasses.asdict(self)
        for k in ("timeout", "target_acc"):  # neither changes what a finished run measured
            d.pop(k)
        return d


@dataclasses.dataclass
class Run:
    variant: str
    variant_args: list
    mode: str
    n: int
    repeat: int

    @property
    def key(self):
        return (self.variant, self.mode, self.n, self.repeat)

    @property
    def run_id(self):
        return f"{self.mode}-n{self.n}-r{self.repeat}" + ("" if self.variant == "base" else f"-{self.variant}")


def gpu_counts(max_n):
    """1, then the powers of two below max_n, then max_n itself: 1, 2, 4 for four GPUs; 1, 2, 3 for three."""
    counts, n = [1], 2
    while n < max_n:
        counts.append(n)
        n *= 2
    return sorted(set(counts + [max_n]))


def applies(mode, n, cpu):
    """Why a mode is left out at some n (None when it runs)."""
    if mode == "single" and n != 1:
        return "01 uses one device"
    if mode == "dp" and cpu and n != 1:
        return "nn.DataParallel has no CPU parallelism (02 runs as one replica on the CPU)"
    if mode == "ddp_multinode" and (n < 2 or n % 2):
        return "05 runs as two nodes of n/2 each, so n must be even"
    return None


def plan(settings, modes, variants, repeats):
    """Every run of the sweep, repeats outermost so that a sweep stopped early still has whole repeats."""
    return [Run(name, args, mode, n, r)
            for r in range(1, repeats + 1) for name, args in variants
            for n in gpu_counts(settings.max_n) for mode in modes if applies(mode, n, settings.cpu) is None]


def skipped(settings, modes):
    """(mode, n, reason) for the combinations the sweep leaves out, so the report can say why."""
    return [(mode, n, applies(mode, n, settings.cpu)) for n in gpu_counts(settings.max_n)
            for mode in modes if applies(mode, n, settings.cpu)]


def free_port():
    # Bind to port 0 and let the OS choose; the tiny race before the script binds it is acceptable here.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun():
    """The torchrun next to this Python (the same environment), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return here if os.path.exists(here) else "torchrun"


def extra_args(mode, environ=os.environ):
    return shlex.split(environ.get(EXTRA_ARGS_ENV, "")) + shlex.split(environ.get(f"{EXTRA_ARGS_ENV}_{mode.upper()}", ""))


def commands(run, settings, metrics_path, python="python"):
    """[(env overrides, argv)] for one run: one entry, or two for the two "nodes" of 05.

    The batch-size rules live here: 02 gets n*B and n GPU ids, every other mode B per process.
    """
    B, n, mode = settings.per_gpu_batch, run.n, run.mode
    common = ["--epochs", str(settings.epochs), "--test-batch-size", str(settings.test_batch_size),
              "--seed", str(settings.seed + run.repeat - 1), "--metrics-json", metrics_path]
    common += ["--max-steps", str(settings.max_steps)] if settings.max_steps else []
    common += ["--synthetic"] if settings.synthetic else ["--data-dir", settings.data_dir]
    # On the CPU the n processes share one host's cores; the scripts' own rule counts processes per node,
    # which for 05's two "nodes" on one host would give each twice its share.
    common += ["--cpu", "--threads", str(max(1, settings.cores // n))] if settings.cpu else []
    common += run.variant_args + extra_args(mode)
    script = SCRIPTS[mode]
    visible = lambda ids: {"CUDA_VISIBLE_DEVICES": ",".join(ids)}
    devices = settings.devices[:n]
    if mode == "single":
        return [(visible(devices), [python, script, "--batch-size", str(B)] + common)]
    if mode == "dp":
        gpus = [] if settings.cpu else ["--gpus", ",".join(str(i) for i in range(n))]  # ids after CUDA_VISIBLE_DEVICES
        return [(visible(devices), [python, script, "--batch-size", str(n * B)] + gpus + common)]
    if mode == "ddp_launch":
        return [(visible(devices), [torchrun(), "--standalone", "--nproc_per_node", str(n), script,
                                    "--batch-size", str(B)] + common)]
    if mode == "ddp_spawn":
        return [(visible(devices), [python, script, "--nprocs", str(n), "--master-port", str(free_port()),
                                    "--batch-size", str(B)] + common)]
    port, half = str(free_port()), n // 2
    return [(visible(devices[r * half:(r + 1) * half]),
             [python, script, "-n", "2", "-g", str(half), "--nr", str(r), "--master-addr", "127.0.0.1",
              "--master-port", port, "--batch-size", str(B)] + common) for r in (0, 1)]


def show(cmds, cpu):
    """The commands as a user would type them (05's two nodes run at the same time, hence '&')."""
    def one(env, argv):
        argv = ["torchrun"] + argv[1:] if argv[0] == torchrun() else argv
        prefix = "" if cpu else " ".join(f"{k}={v}" for k, v in env.items()) + " "
        return prefix + shlex.join(argv)
    return " & ".join(one(env, argv) for env, argv in cmds)


def _stop(procs):
    """Stop whole process groups: a torchrun or spawn parent leaves its workers behind otherwise."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + KILL_GRACE_S
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            time.sleep(0.1)
    for p in procs:
        try:  # the leader may be gone while its children still run
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def execute(cmds, cwd, log_paths, timeout):
    """Run the commands at once; return (exit code, timed_out). Ctrl-C stops them and is re-raised."""
    procs = []
    try:
        for (env_over, argv), log_path in zip(cmds, log_paths):
            env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_DEVICE_ORDER="PCI_BUS_ID", **env_over)
            with open(log_path, "w") as log:
                log.write(f"$ {shlex.join(argv)}\n")
                log.flush()
                procs.append(subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
        deadline, failed_at = time.monotonic() + timeout, None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                _stop(procs)
                return _exit_code(procs), True
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > PEER_GRACE_S:
                _stop(procs)
                break
            time.sleep(0.1)
        _stop(procs)  # children a script left behind must not hold ports or cores for the next run
        return _exit_code(procs), False
    except BaseException:
        _stop(procs)
        raise


def _exit_code(procs):
    codes = [p.poll() for p in procs]
    return next((c for c in codes if c not in (None, 0)), codes[0] if codes else None)


def log_tail(paths, lines=LOG_TAIL_LINES):
    tails = []
    for path in paths:
        try:
            with open(path, errors="replace") as f:
                tails.append("\n".join(f.read().splitlines()[-lines:]))
        except OSError:
            pass
    return "\n---\n".join(tails)


def time_to_target(record, target):
    """Training seconds (evaluation left out) until an epoch's test accuracy reaches the target, else None."""
    elapsed = 0.0
    for epoch in record.get("epochs_detail", []):
        elapsed += epoch["train_time_s"]
        if epoch["test_accuracy"] >= target:
            return elapsed
    return None


# runs.csv: names from the metrics record where they overlap, then the harness's own.
RECORD_COLUMNS = ["world_size", "nodes", "device_type", "backend", "threads", "per_device_batch", "global_batch",
                  "lr", "epochs", "steps", "train_samples", "samples_per_s", "test_accuracy", "test_loss",
                  "peak_memory_bytes", "synthetic", "torch_version"]
COLUMNS = (["run_id", "variant", "mode", "n", "repeat", "status", "exit_code", "error", "loader_batch"]
           + RECORD_COLUMNS + ["time_to_target_s", "target_accuracy", "wall_s", "started_at", "command",
                               "log_path", "metrics_path", "log_tail"])


def perform(run, settings, repo, out_dir):
    """Run one benchmark run and return its runs.csv row (never raises for a failed run)."""
    rel = lambda p: os.path.relpath(p, out_dir)
    metrics = os.path.join(out_dir, "metrics", f"{run.run_id}.json")
    logs = [os.path.join(out_dir, "logs", f"{run.run_id}.log")]
    if os.path.exists(metrics):
        os.remove(metrics)  # a redone run must never report the record of an earlier attempt
    cmds = commands(run, settings, _for_scripts(metrics, repo))
    logs += [os.path.join(out_dir, "logs", f"{run.run_id}.node{i}.log") for i in range(1, len(cmds))]
    started, t0 = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.monotonic()
    code, timed_out = execute(cmds, repo, logs, settings.timeout)
    row = dict(run_id=run.run_id, variant=run.variant, mode=run.mode, n=run.n, repeat=run.repeat,
               exit_code=code, loader_batch=int(cmds[0][1][cmds[0][1].index("--batch-size") + 1]),
               wall_s=round(time.monotonic() - t0, 2), started_at=started, command=show(cmds, settings.cpu),
               log_path=rel(logs[0]), metrics_path=rel(metrics), target_accuracy=settings.target_acc)
    record, error = _read_record(metrics)
    if timed_out:
        row.update(status="timeout", error=f"killed after the {settings.timeout:g} s timeout")
    elif code != 0:
        row.update(status="failed", error=f"exit code {code}")
    elif record is None:
        row.update(status="failed", error=error)
    else:
        row.update(status="ok", error="")
    if record is not None:
        row.update({k: _integral(record.get(k)) for k in RECORD_COLUMNS})
        row["time_to_target_s"] = None if record.get("synthetic") else time_to_target(record, settings.target_acc)
    if row["status"] != "ok":
        row["log_tail"] = log_tail(logs)
    return row


def _integral(value):
    # A count written as 64.0 by a script stays a count in the tables.
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _read_record(path):
    try:
        with open(path) as f:
            return json.load(f), None
    except FileNotFoundError:
        return None, "exited 0 but wrote no metrics record"
    except (OSError, ValueError) as e:
        return None, f"unreadable metrics record: {e}"


def _for_scripts(path, repo):
    """Paths inside the repository are given relative to it (the scripts run there), as a user would type them."""
    path = os.path.abspath(path)
    inside = os.path.commonpath([path, repo]) == repo
    return os.path.relpath(path, repo) if inside else path
