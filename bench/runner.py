"""Starting and stopping every process of a sweep: the runs (a runs.csv row each; a failure never stops the
sweep), and bench/measure/'s. Each in a process group of its own: a timeout or Ctrl-C stops all it spawned."""
import contextlib
import csv
import dataclasses
import itertools
import math
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

from bench.commands import as_typed, commands, visible
from bench.outputs import read_json, write_atomically
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
    """SIGTERM, then SIGKILL, to whole process groups: a torchrun or spawn parent leaves its workers otherwise."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # the leader may be gone, not its children
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + KILL_GRACE_S
        while sig == signal.SIGTERM and any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)


def run_processes(cmds, log_paths, timeout):
    """Run [(environment, argv)] at once, each into its log; (exit code, timed out). Ctrl-C stops them."""
    procs = []
    try:
        for (env, argv), log_path in zip(cmds, log_paths):
            pathlib.Path(log_path).write_text(f"$ {shlex.join(argv)}\n")
            with open(log_path, "a") as log:
                procs.append(subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
        deadline, failed_at, timed_out = time.monotonic() + timeout, None, False
        while any(p.poll() is None for p in procs) and not timed_out:
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > PEER_GRACE_S:
                break
            time.sleep(0.1)
            timed_out = time.monotonic() > deadline
    finally:
        stop(procs)  # also after a clean exit: children a script left behind must not hold ports or cores
    return next((p.poll() for p in procs if p.poll() != 0), 0), timed_out


def log_tail(paths, lines=15):
    return "\n---\n".join("\n".join(pathlib.Path(p).read_text(errors="replace").splitlines()[-lines:]) for p in paths)


def time_to_target(record, target):
    """Training seconds (evaluation left out) until an epoch's test accuracy reaches the target, else None."""
    epochs = record.get("epochs_detail", [])
    elapsed = itertools.accumulate(epoch["train_time_s"] for epoch in epochs)
    return next((t for t, epoch in zip(elapsed, epochs) if epoch["test_accuracy"] >= target), None)


def status(code, timed_out, record, settings):
    """(status, error): ok only when the run exited 0, wrote its record, and trained where it was asked to."""
    if timed_out:
        return "timeout", f"killed after the {settings.timeout:g} s timeout"
    if code != 0:
        return "failed", f"exit code {code}"
    if record is None:
        return "failed", "exited 0 but wrote no readable metrics record"
    if not settings.cpu and record.get("device_type") != "cuda":  # a GPU sweep's row must be a GPU's result
        return "failed", f"trained on {record.get('device_type')}, not on a GPU: can {sys.executable} use CUDA?"
    return "ok", ""


def run_one(run, settings, out_dir):
    """Run one benchmark run and return its runs.csv row (never raises for a failed run)."""
    metrics = os.path.join(out_dir, "metrics", f"{run.run_id}.json")
    snapshots = os.path.join(out_dir, f"snapshot-{run.run_id}")  # 06's, deleted after the run
    pathlib.Path(metrics).unlink(missing_ok=True)  # a redone run must never report or resume an earlier attempt
    shutil.rmtree(snapshots, ignore_errors=True)
    os.makedirs(snapshots)
    cmds = commands(run, settings, metrics, os.path.join(snapshots, "snapshot.pt"))
    logs = [os.path.join(out_dir, "logs", f"{run.run_id}{f'.node{i}' if i else ''}.log") for i in range(len(cmds))]
    started, t0 = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.monotonic()
    code, timed_out = run_processes(cmds, logs, settings.timeout)
    wall = round(time.monotonic() - t0, 2)
    shutil.rmtree(snapshots, ignore_errors=True)
    record = read_json(metrics)
    state, error = status(code, timed_out, record, settings)
    argv = cmds[0][1]
    row = dict(dataclasses.asdict(run), run_id=run.run_id, status=state, exit_code=code, error=error, wall_s=wall,
               started_at=started, target_accuracy=settings.target_acc, command=as_typed(cmds, settings.cpu),
               loader_batch=argv[argv.index("--batch-size") + 1], log_path=os.path.relpath(logs[0], out_dir),
               metrics_path=os.path.relpath(metrics, out_dir), log_tail=log_tail(logs) if state != "ok" else None)
    if record is not None:
        row.update({k: record.get(k) for k in RECORD_COLUMNS})
        row["time_to_target_s"] = None if record.get("synthetic") else time_to_target(record, settings.target_acc)
    return row


def write_runs(out_dir, rows):
    """runs.csv (with the csv module: pandas takes seconds to import, and only the report needs it)."""
    def write(tmp):
        with open(tmp, "w", newline="") as f:
            csv.writer(f).writerows([COLUMNS] + [[row.get(c) for c in COLUMNS] for row in rows])
    write_atomically(os.path.join(out_dir, "runs.csv"), write)


def read_runs(out_dir):
    """runs.csv's rows as written (strings), to be written again unchanged."""
    with open(os.path.join(out_dir, "runs.csv"), newline="") as f:
        return list(csv.DictReader(f))


def run_plan(runs, done, settings, out_dir):
    """Run what is not done (done: earlier ok rows by run id, kept); runs.csv is rewritten after every run."""
    todo, fresh, t0 = [r for r in runs if r.run_id not in done], {}, time.monotonic()

    def rows():  # in plan order, then the earlier ones outside the plan
        ids = [r.run_id for r in runs] + [i for i in done if i not in {r.run_id for r in runs}]
        return [fresh.get(i) or done[i] for i in ids if i in fresh or i in done]

    for i, run in enumerate(todo, 1):
        tag = f"[{i}/{len(todo)}] {run.mode} n={run.n} ({'processes' if settings.cpu else 'GPUs'}) {run.run_id}"
        elapsed = time.monotonic() - t0
        left = f", about {timedelta(seconds=round(elapsed / (i - 1) * (len(todo) - i + 1)))} left" if i > 1 else ""
        print(f"{tag}: start, elapsed {timedelta(seconds=round(elapsed))}{left}", flush=True)
        row = fresh[run.run_id] = run_one(run, settings, out_dir)
        result = (f"{row['samples_per_s'] or 0:,.0f} samples/s, accuracy {row['test_accuracy'] or 0:.2%}"
                  if row["status"] == "ok" else f"{row['error']}, log {os.path.join(out_dir, row['log_path'])}")
        print(f"{tag}: {row['status']} in {row['wall_s']:.1f} s, {result}", flush=True)
        write_runs(out_dir, rows())
    return rows()


def run_tool(tool, args, out_dir, name, gpus):
    """A tool of bench/measure/ as its own process (the harness never initialises CUDA): its JSON or {'error'}."""
    path, log = os.path.join(out_dir, f"{name}.json"), os.path.join(out_dir, "logs", f"{name}.log")
    pathlib.Path(path).unlink(missing_ok=True)  # never report an earlier sweep's result
    argv = [sys.executable, "-m", f"bench.measure.{tool}", *map(str, args), "--json", path]
    code, timed_out = run_processes([(visible(gpus), argv)], [log], MEASURE_TIMEOUT_S)
    if timed_out or code != 0:
        why = f"killed after {MEASURE_TIMEOUT_S} s" if timed_out else f"exit code {code}"
        return {"error": f"{why}: {log_tail([log], lines=1)} (log {os.path.relpath(log, out_dir)})"}
    return read_json(path) or {"error": f"no result in {path}"}


def measure_loader(settings, out_dir):
    """The input pipeline alone, with the sweep's data, first batch and first device."""
    args = ["--batch-size", settings.batches[0], "--passes", 3] + ["--cpu"] * settings.cpu
    args += ["--synthetic"] if settings.synthetic else ["--data-dir", settings.data_dir]
    return run_tool("loader_speed", args, out_dir, "loader_speed", settings.gpus[:1])


def measure_allreduce(settings, out_dir):
    """{n: all-reduce of the model's gradient} for every n >= 2, with the sweep's backend and devices."""
    results = {}
    for n in [n for n in device_counts(settings.max_n) if n >= 2]:
        args = ["--nprocs", n, "--min-bytes", 4096, "--max-bytes", 4096, "--warmup", 3, "--iters", 10,
                "--no-env"] + ["--cpu"] * settings.cpu  # a few seconds each
        results[n] = run_tool("allreduce", args, out_dir, f"allreduce-n{n}", settings.gpus[:n])
        time_us = (results[n].get("gradient_row") or {}).get("time_us", math.nan)
        print(f"all-reduce of the gradient at n={n}: {time_us / 1e3:.2f} ms {results[n].get('error', '')}", flush=True)
    return results
