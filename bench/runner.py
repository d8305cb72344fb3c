"""Starting and stopping every process the harness starts: the runs (one runs.csv row each; a failed run
never stops the sweep) and, before them, the loader and all-reduce measurements of bench/measure/.

Each command starts in its own process group so that a timeout or Ctrl-C stops it and every child it
spawned (torchrun workers, spawn children, Lightning's processes).
"""
import csv
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone

from bench.commands import commands, shown, visible
from bench.files import read_json, write_atomically
from bench.plan import device_counts
from bench.scripts import REPO

KILL_GRACE_S = 5  # SIGTERM first so that process groups can be destroyed cleanly, then SIGKILL
PEER_GRACE_S = 15  # once one node of 05 has failed, the other would only wait for its rendezvous timeout
MEASURE_TIMEOUT_S = 300
# runs.csv: names from the metrics record where they overlap, then the harness's own.
RECORD_COLUMNS = ["world_size", "nodes", "device_type", "backend", "threads", "per_device_batch", "global_batch",
                  "lr", "epochs", "steps", "train_samples", "samples_per_s", "test_accuracy", "test_loss",
                  "peak_memory_bytes", "synthetic", "torch_version"]
COLUMNS = (["run_id", "variant", "mode", "n", "batch", "repeat", "status", "exit_code", "error", "loader_batch"]
           + RECORD_COLUMNS + ["time_to_target_s", "target_accuracy", "wall_s", "started_at", "command",
                               "log_path", "metrics_path", "log_tail"])


def stop(procs):
    """Stop whole process groups: a torchrun or spawn parent leaves its workers behind otherwise."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            try:  # the leader may be gone while its children still run
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + KILL_GRACE_S
        while sig == signal.SIGTERM and any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)


def run_processes(cmds, log_paths, timeout):
    """Run the commands at once, each logging to its file; (exit code, timed out). Ctrl-C stops them, re-raised."""
    procs = []
    try:
        for (env, argv), log_path in zip(cmds, log_paths):
            with open(log_path, "w") as log:
                log.write(f"$ {shlex.join(argv)}\n")
                log.flush()
                procs.append(subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
        deadline, failed_at, timed_out = time.monotonic() + timeout, None, False
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            timed_out = now > deadline
            if timed_out or (failed_at is not None and now - failed_at > PEER_GRACE_S):
                break
            time.sleep(0.1)
    finally:
        stop(procs)  # also after a clean exit: children a script left behind must not hold ports or cores
    codes = [p.poll() for p in procs]
    return next((c for c in codes if c != 0), 0), timed_out


def log_tail(paths, lines=15):
    tails = []
    for path in paths:
        with open(path, errors="replace") as f:
            tails.append("\n".join(f.read().splitlines()[-lines:]))
    return "\n---\n".join(tails)


def time_to_target(record, target):
    """Training seconds (evaluation left out) until an epoch's test accuracy reaches the target, else None."""
    elapsed = 0.0
    for epoch in record.get("epochs_detail", []):
        elapsed += epoch["train_time_s"]
        if epoch["test_accuracy"] >= target:
            return elapsed
    return None


def read_record(path):
    """(the metrics record, None) or (None, why there is none)."""
    try:
        with open(path) as f:
            return json.load(f), None
    except FileNotFoundError:
        return None, "exited 0 but wrote no metrics record"
    except (OSError, ValueError) as e:
        return None, f"unreadable metrics record: {e}"


def status(code, timed_out, record, why_no_record, settings):
    """(status, error): ok only when the run exited 0, wrote its record, and trained where it was asked to."""
    if timed_out:
        return "timeout", f"killed after the {settings.timeout:g} s timeout"
    if code != 0:
        return "failed", f"exit code {code}"
    if record is None:
        return "failed", why_no_record
    if not settings.cpu and record.get("device_type") != "cuda":  # a GPU sweep's row must be a GPU's figure
        return "failed", f"trained on {record.get('device_type')}, not on a GPU: can {sys.executable} use CUDA?"
    return "ok", ""


def run_one(run, settings, out_dir):
    """Run one benchmark run and return its runs.csv row (never raises for a failed run)."""
    metrics = os.path.join(out_dir, "metrics", f"{run.run_id}.json")
    snapshots = os.path.join(out_dir, f"snapshot-{run.run_id}")  # deleted after the run: results stay small
    if os.path.exists(metrics):  # a redone run must never report, or resume from, an earlier attempt
        os.remove(metrics)
    shutil.rmtree(snapshots, ignore_errors=True)
    cmds = commands(run, settings, metrics, os.path.join(snapshots, "snapshot.pt"))
    if run.mode == "ddp_fault_tolerant":
        os.makedirs(snapshots)
    logs = [os.path.join(out_dir, "logs", f"{run.run_id}{f'.node{i}' if i else ''}.log") for i in range(len(cmds))]
    started, t0 = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.monotonic()
    code, timed_out = run_processes(cmds, logs, settings.timeout)
    wall = round(time.monotonic() - t0, 2)
    shutil.rmtree(snapshots, ignore_errors=True)
    record, why = read_record(metrics)
    state, error = status(code, timed_out, record, why, settings)
    argv = cmds[0][1]
    row = dict(run_id=run.run_id, variant=run.variant, mode=run.mode, n=run.n, batch=run.batch, repeat=run.repeat,
               status=state, exit_code=code, error=error, loader_batch=int(argv[argv.index("--batch-size") + 1]),
               wall_s=wall, started_at=started, command=shown(cmds, settings.cpu), target_accuracy=settings.target_acc,
               log_path=os.path.relpath(logs[0], out_dir), metrics_path=os.path.relpath(metrics, out_dir))
    if record is not None:
        row.update({k: record.get(k) for k in RECORD_COLUMNS})
        row["time_to_target_s"] = None if record.get("synthetic") else time_to_target(record, settings.target_acc)
    if state != "ok":
        row["log_tail"] = log_tail(logs)
    return row


def write_runs(out_dir, rows):
    """runs.csv (the csv module: pandas takes seconds to import, and only the report needs it)."""
    def write(tmp):
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    write_atomically(os.path.join(out_dir, "runs.csv"), write)


def read_runs(out_dir):
    """runs.csv's rows as written (strings), to be written again unchanged."""
    with open(os.path.join(out_dir, "runs.csv"), newline="") as f:
        return list(csv.DictReader(f))


def clock(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def run_plan(runs, done, settings, out_dir):
    """Run what is not done yet; runs.csv is rewritten after every run so that a stop loses at most one.
    done: the ok rows of an earlier attempt, by key; kept, and so are those outside this plan (other --modes)."""
    todo, fresh, t0 = [r for r in runs if r.key not in done], {}, time.monotonic()
    unit = "processes" if settings.cpu else "GPUs"

    def rows():
        planned = {r.key for r in runs}
        return ([fresh.get(r.key) or done[r.key] for r in runs if r.key in fresh or r.key in done]
                + [row for key, row in done.items() if key not in planned])

    for i, run in enumerate(todo, 1):
        tag = f"[{i}/{len(todo)}] {run.mode} n={run.n} ({unit}) B={run.batch}" \
            + (f" repeat {run.repeat}" if run.repeat > 1 else "") + ("" if run.variant == "base" else f" {run.variant}")
        left = (time.monotonic() - t0) / (i - 1) * (len(todo) - i + 1) if i > 1 else None
        print(f"{tag}: start, elapsed {clock(time.monotonic() - t0)}" + (f", about {clock(left)} left" if left else ""),
              flush=True)
        row = fresh[run.key] = run_one(run, settings, out_dir)
        if row["status"] == "ok":
            result = f"{row['samples_per_s'] or 0:,.0f} samples/s, accuracy {row['test_accuracy'] or 0:.2%}"
        else:
            result = f"{row['error']}, log {os.path.join(out_dir, row['log_path'])}"
        print(f"{tag}: {row['status']} in {row['wall_s']:.1f} s, {result}", flush=True)
        write_runs(out_dir, rows())
    return rows()


def measure(tool, args, out_dir, name, gpus):
    """Run a tool of bench/measure/ as its own process (the harness never initialises CUDA): its JSON, or
    {'error': ...}. Its log is logs/<name>.log."""
    path, log = os.path.join(out_dir, f"{name}.json"), os.path.join(out_dir, "logs", f"{name}.log")
    if os.path.exists(path):
        os.remove(path)  # never report an earlier sweep's figure
    argv = [sys.executable, "-m", f"bench.measure.{tool}", *map(str, args), "--json", path]
    code, timed_out = run_processes([(visible(gpus), argv)], [log], MEASURE_TIMEOUT_S)
    if timed_out or code != 0:
        why = f"killed after {MEASURE_TIMEOUT_S} s" if timed_out else f"exit code {code}"
        return {"error": f"{why}: {log_tail([log], lines=1)} (log {os.path.relpath(log, out_dir)})"}
    return read_json(path) or {"error": f"no result in {path}"}


def loader_figure(settings, out_dir):
    """The input pipeline alone, with the sweep's data, first batch and first device (report.md sets it
    against the sweep's own 01 throughput, so the tool times no training: --train-steps 0)."""
    args = ["--batch-size", settings.batches[0], "--train-steps", 0, "--passes", 3]
    args += (["--synthetic"] if settings.synthetic else ["--data-dir", settings.data_dir]) + ["--cpu"] * settings.cpu
    return measure("loader_speed", args, out_dir, "loader_speed", settings.gpus[:1])


def allreduce_figures(settings, out_dir):
    """{n: all-reduce time of the model's gradient} for every n >= 2, with the sweep's backend and devices:
    4 KiB (the latency) and the gradient only, a few seconds each."""
    args = ["--min-bytes", 4096, "--max-bytes", 4096, "--warmup", 3, "--iters", 10, "--timeout", 60, "--no-env"]
    return {n: measure("allreduce", args + ["--nprocs", n] + (["--cpu"] if settings.cpu else ["--backend", "nccl"]),
                       out_dir, f"allreduce-n{n}", settings.gpus[:n])
            for n in device_counts(settings.max_n) if n >= 2}
