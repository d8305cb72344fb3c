"""What a sweep writes: files written atomically (a reader, or a Ctrl-C, never sees half of one), JSON, and runs.csv,
its rows, rewritten after every run and read back for --resume (with csv: pandas takes seconds to import)."""
import contextlib
import csv
import json
import os
import pathlib

# From the metrics record; not its per_device_batch (= global_batch / world_size): the run's own is the plan's.
RECORD_COLUMNS = ["world_size", "nodes", "device_type", "backend", "threads", "global_batch", "lr", "epochs",
                  "steps", "train_samples", "samples_per_s", "test_accuracy", "test_loss", "peak_memory_bytes",
                  "synthetic", "torch_version"]
COLUMNS = (["run_id", "variant", "mode", "n", "per_device_batch", "repeat", "status", "exit_code", "error",
            "busy_before", "loader_batch", "timeout_s"] + RECORD_COLUMNS
           + ["time_to_target_s", "target_accuracy", "wall_s", "started_at", "command", "log_path", "metrics_path",
              "log_tail"])


def write_atomically(path, write):
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def write_text(path, text):
    write_atomically(path, lambda tmp: pathlib.Path(tmp).write_text(text))


def write_json(path, obj):
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path, default=None):
    with contextlib.suppress(OSError, ValueError):
        return json.loads(pathlib.Path(path).read_text())
    return default


def write_runs(out_dir, rows):
    def write(tmp):
        with open(tmp, "w", newline="") as f:
            csv.writer(f).writerows([COLUMNS] + [[row.get(c) for c in COLUMNS] for row in rows])
    write_atomically(os.path.join(out_dir, "runs.csv"), write)


def read_runs(out_dir):
    """runs.csv's rows as written (strings), to be written again unchanged."""
    with open(os.path.join(out_dir, "runs.csv"), newline="") as f:
        return list(csv.DictReader(f))
