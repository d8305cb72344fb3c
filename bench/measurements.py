"""The tools of bench/measure/ before a sweep, each in its own process: the harness never initialises CUDA."""
import math
import os
import pathlib
import sys

from bench.checks import advice, cause_line
from bench.commands import visible
from bench.outputs import read_json
from bench.plan import device_counts
from bench.processes import log_tail, run_processes

LOADER_TIMEOUT_S = 300
# The collective before the sweep: seconds when it works. One that cannot connect costs this, once per n.
COLLECTIVE_TIMEOUT_S = 60


def run_tool(tool, name, args, n, seconds, settings, out_dir):
    """A tool of bench/measure/ on the sweep's first n GPUs: its JSON, or {'error'} saying why there is none.
    It gets seconds, or the runs' --timeout where shorter: no wait outlasts the one the user gave."""
    path, log = os.path.join(out_dir, f"{name}.json"), os.path.join(out_dir, "logs", f"{name}.log")
    pathlib.Path(path).unlink(missing_ok=True)  # never report an earlier sweep's result
    argv = [sys.executable, "-m", f"bench.measure.{tool}", *map(str, args), "--json", path] + ["--cpu"] * settings.cpu
    timeout = min(seconds, settings.timeout or math.inf)
    code, timed_out = run_processes([(visible(settings.gpus[:n]), argv)], [log], timeout)
    if code == 0 and not timed_out and (result := read_json(path)):
        return result
    # Why, the log line that names the cause, and the fix: once, here, for every way it can fail.
    why = f"no answer within {timeout} s" if timed_out else f"exit code {code}" if code else f"no result in {path}"
    text = f"{why}\n{log_tail([log], lines=40)}"
    cause, fix = cause_line(text), advice(text)
    return {"error": f"{why}: {cause} (log {os.path.relpath(log, out_dir)}); {fix}", "why": why, "cause": cause,
            "advice": fix, "log": log}


def measure_loader(settings, out_dir):
    data = ["--synthetic"] if settings.synthetic else ["--data-dir", settings.data_dir]
    args = ["--batch-size", settings.per_device_batches[0], "--passes", 3, *data]
    return run_tool("loader_speed", "loader_speed", args, 1, LOADER_TIMEOUT_S, settings, out_dir)


def measure_allreduce(settings, out_dir):
    results = {}
    for n in [n for n in device_counts(settings.max_n) if n >= 2]:  # a few seconds each
        args = ["--nprocs", n, "--min-bytes", 4096, "--max-bytes", 4096, "--warmup", 3, "--iters", 10, "--no-env"]
        results[n] = run_tool("allreduce", f"allreduce-n{n}", args, n, COLLECTIVE_TIMEOUT_S, settings, out_dir)
        time_us = (results[n].get("gradient_row") or {}).get("time_us", math.nan)
        print(f"all-reduce of the gradient at n={n}: {time_us / 1e3:.2f} ms {results[n].get('error', '')}", flush=True)
    return results


def failed_collectives(allreduce):
    """{n: why} for each n whose collective failed before the sweep (env.json's keys are strings once read back)."""
    return {int(n): result["error"] for n, result in (allreduce or {}).items() if "error" in result}
