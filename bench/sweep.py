"""The sweep itself: each planned run started as a user would, timed, bounded, and its row of runs.csv."""
import dataclasses
import itertools
import os
import pathlib
import shutil
import sys
import time
from datetime import datetime, timedelta, timezone

from bench import plan
from bench.checks import EXIT_ABORT, EXIT_ABORT_AGAIN, advice, busy, gpu_usage
from bench.commands import as_typed, commands
from bench.family import MODES
from bench.outputs import RECORD_COLUMNS, read_json, write_json, write_runs
from bench.processes import log_tail, run_processes


def time_to_target(record, target):
    """Training seconds (evaluation left out) until an epoch's test accuracy reaches the target, else None."""
    epochs = record.get("epochs_detail", [])
    elapsed = itertools.accumulate(epoch["train_time_s"] for epoch in epochs)
    return next((t for t, epoch in zip(elapsed, epochs) if epoch["test_accuracy"] >= target), None)


def completed(record, argv):
    """The run's record with the harness's whole command as its argv: the script saw only its own arguments."""
    return {**record, "argv": argv}


def status(code, timed_out, record, settings, timeout):
    """(status, error): ok only when the run exited 0, wrote its record, and trained where it was asked to."""
    if timed_out:
        return "timeout", f"killed after its {timeout:.0f} s timeout"
    if code != 0:
        return "failed", f"exit code {code}"
    if record is None:
        return "failed", "exited 0 but wrote no readable metrics record"
    if not settings.cpu and record.get("device_type") != "cuda":  # a GPU sweep's row must be a GPU's result
        return "failed", f"trained on {record.get('device_type')}, not on a GPU: can {sys.executable} use CUDA?"
    return "ok", ""


def run_one(run, settings, out_dir):
    metrics = os.path.join(out_dir, "metrics", f"{run.run_id}.json")
    snapshots = os.path.join(out_dir, f"snapshot-{run.run_id}")  # 06's, deleted after the run
    in_use, timeout = "; ".join(busy(gpu_usage(settings.gpus[:run.n]))), plan.timeout_s(run, settings)
    for attempt in range(1 + EXIT_ABORT_AGAIN):  # torch's abort at a process's exit is not the run's: again
        pathlib.Path(metrics).unlink(missing_ok=True)  # a redone run must never report or resume an earlier attempt
        shutil.rmtree(snapshots, ignore_errors=True)
        os.makedirs(snapshots)
        cmds = commands(run, settings, metrics, os.path.join(snapshots, "snapshot.pt"))
        logs = [os.path.join(out_dir, "logs", f"{run.run_id}{f'.node{i}' if i else ''}.log") for i in range(len(cmds))]
        started, t0 = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.monotonic()
        code, timed_out = run_processes(cmds, logs, timeout)
        wall = round(time.monotonic() - t0, 2)
        if code == 0 or timed_out or attempt == EXIT_ABORT_AGAIN or EXIT_ABORT not in log_tail(logs, lines=60):
            break
        print(f"{run.run_id}: torch aborted a process at its exit ({EXIT_ABORT}); the run starts again", flush=True)
    shutil.rmtree(snapshots, ignore_errors=True)
    record = read_json(metrics)
    if record:  # completed once, where it lies: the report and a reader of metrics/ see one record
        record = completed(record, cmds[0][1])
        write_json(metrics, record)
    state, error = status(code, timed_out, record, settings, timeout)
    if state != "ok":
        error = f"{error}; {advice(log_tail(logs, lines=40))}"
    reached = time_to_target(record, settings.target_acc) if record and not record.get("synthetic") else None
    return dict(dataclasses.asdict(run), run_id=run.run_id, status=state, exit_code=code, error=error, wall_s=wall,
                busy_before=in_use, timeout_s=round(timeout), started_at=started, target_accuracy=settings.target_acc,
                command=as_typed(cmds, settings.cpu), log_path=os.path.relpath(logs[0], out_dir),
                loader_batch=MODES[run.mode].batch.loader_batch(run.per_device_batch, run.n),
                metrics_path=os.path.relpath(metrics, out_dir), log_tail=log_tail(logs) if state != "ok" else None,
                time_to_target_s=reached, **{k: (record or {}).get(k) for k in RECORD_COLUMNS})


def run_plan(runs, done, settings, out_dir, failed_collectives):
    """Run what is not done (done: earlier ok rows by id), but not where the collective failed ({n: why}); all rows."""
    rows = {**dict.fromkeys(r.run_id for r in runs), **done}  # in plan order, then earlier rows outside the plan
    todo, t0 = [r for r in runs if r.run_id not in done], time.monotonic()
    estimates = [plan.estimate_s(r, settings) for r in todo]  # the time left: theirs, at the pace of the runs done
    for i, run in enumerate(todo, 1):
        tag = f"[{i}/{len(todo)}] {run.mode} n={run.n} ({'processes' if settings.cpu else 'GPUs'}) {run.run_id}"
        elapsed = time.monotonic() - t0
        pace = elapsed / sum(estimates[:i - 1]) if i > 1 else None  # seconds taken per second estimated
        left = f", about {timedelta(seconds=round(pace * sum(estimates[i - 1:])))} left at this pace" if pace else ""
        print(f"{tag}: start, elapsed {timedelta(seconds=round(elapsed))}{left}", flush=True)
        broken = failed_collectives.get(run.n) if MODES[run.mode].collective else None
        if broken:  # not started: no log, no record
            row = dict(dataclasses.asdict(run), run_id=run.run_id, status="skipped", command="", log_path="-",
                       error=f"not run: the all-reduce at n = {run.n} failed before the sweep: {broken}",
                       metrics_path=os.path.join("metrics", f"{run.run_id}.json"),
                       log_tail="(not started: the error names the all-reduce's log)")
        else:
            row = run_one(run, settings, out_dir)
        rows[run.run_id] = row
        result = (f"{row['samples_per_s'] or 0:,.0f} samples/s, accuracy {row['test_accuracy'] or 0:.2%}"
                  if row["status"] == "ok" else row["error"] if row["status"] == "skipped"
                  else f"{row['error']}, log {os.path.join(out_dir, row['log_path'])}")
        print(f"{tag}: {row['status']} in {row.get('wall_s') or 0:.1f} s, {result}", flush=True)
        if row.get("busy_before"):
            print(f"{tag}: WARNING, its GPUs were busy when it started: {row['busy_before']}", flush=True)
        write_runs(out_dir, [row for row in rows.values() if row])
    return [row for row in rows.values() if row]
