"""summary.csv and report.md from runs.csv: medians per (variant, mode, n), speed-up and scaling efficiency."""
import math
import os

import pandas as pd

from files import write_csv, write_text
from sweep import MODES, SCRIPTS

MEDIAN_COLUMNS = ["samples_per_s", "time_to_target_s", "test_accuracy", "test_loss", "peak_memory_bytes", "wall_s"]
FIRST_COLUMNS = ["world_size", "nodes", "per_device_batch", "global_batch", "loader_batch"]
PLOTS = [("throughput.png", "Throughput"), ("efficiency.png", "Scaling efficiency"),
         ("time_to_target.png", "Time to target accuracy"), ("accuracy.png", "Test accuracy")]


def summarize(runs):
    """Median of the ok runs per (variant, mode, n); E(n) = X(n) / (n * X(01 at n=1)) within each variant."""
    ok = runs[runs["status"] == "ok"]
    if ok.empty:
        return pd.DataFrame(columns=["variant", "mode", "n", "runs"] + FIRST_COLUMNS + MEDIAN_COLUMNS
                            + ["speedup", "efficiency"])
    groups = ok.groupby(["variant", "mode", "n"], sort=False)
    summary = groups[FIRST_COLUMNS].first().join(groups[MEDIAN_COLUMNS].median(numeric_only=False))
    summary.insert(0, "runs", groups.size())
    summary = summary.reset_index()
    baseline = summary[(summary["mode"] == "single") & (summary["n"] == 1)].set_index("variant")["samples_per_s"]
    base = summary["variant"].map(baseline)
    summary["speedup"] = summary["samples_per_s"] / base
    summary["efficiency"] = summary["speedup"] / summary["n"]
    order = {m: i for i, m in enumerate(MODES)}
    return summary.sort_values(["variant", "n", "mode"], key=lambda c: c.map(order) if c.name == "mode" else c,
                               ignore_index=True)


def _fmt(value, column):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if column in ("efficiency", "test_accuracy"):
        return f"{value:.1%}" if column == "efficiency" else f"{value:.2%}"
    if column == "speedup":
        return f"{value:.2f}x"
    if column == "peak_memory_bytes":
        return f"{value / 2**20:.0f} MiB"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
    return str(value)


def markdown_table(frame, columns, headers=None):
    headers = headers or columns
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(columns)]
    for _, row in frame.iterrows():
        lines.append("| " + " | ".join(_fmt(row[c], c).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(lines)


SUMMARY_VIEW = [("variant", "variant"), ("mode", "mode"), ("n", "n"), ("runs", "runs"),
                ("world_size", "world size"), ("global_batch", "global batch"),
                ("samples_per_s", "samples/s"), ("speedup", "speed-up vs 01"), ("efficiency", "efficiency E(n)"),
                ("time_to_target_s", "time to target (s)"), ("test_accuracy", "test accuracy"),
                ("peak_memory_bytes", "peak memory"), ("wall_s", "wall (s)")]


def write_summary(out_dir, runs):
    summary = summarize(runs)
    write_csv(os.path.join(out_dir, "summary.csv"), summary)
    return summary


def write_report(out_dir, runs, summary, env, settings, skipped, harness_command):
    """report.md: readable on its own, with the table, the plots, the environment and every command."""
    cols = [c for c, _ in SUMMARY_VIEW if c != "variant" or summary["variant"].nunique() > 1]
    heads = [h for c, h in SUMMARY_VIEW if c in cols]
    unit = "processes" if settings.cpu else "GPUs"
    lines = [f"# Multi-GPU MNIST benchmark: {env['hardware']}", "",
             f"n = number of {unit}. Batch-size rules: 01 trains with --batch-size {settings.per_gpu_batch}; "
             f"02 gets --batch-size n x {settings.per_gpu_batch} and n GPUs (on the CPU it has no parallelism and "
             f"runs at n = 1 only); 03, 04 and 05 get --batch-size "
             f"{settings.per_gpu_batch} in each of n processes, so every multi-device mode has the global batch "
             f"n x {settings.per_gpu_batch}. Values are medians over the ok runs of each row; speed-up and "
             f"E(n) = X(n) / (n X(01)) compare with 01 at n = 1.", "",
             f"Settings: {settings.epochs} epoch(s), " +
             (f"at most {settings.max_steps} steps per epoch, " if settings.max_steps else "full epochs, ") +
             f"test batch {settings.test_batch_size}, target accuracy {settings.target_acc:.2%}, " +
             ("**synthetic data** (throughput only: accuracy and time to target are meaningless and left out)"
              if settings.synthetic else f"MNIST from {settings.data_dir}") + ".", "",
             "## Summary", "", markdown_table(summary, cols, heads) if len(summary) else "No run finished.", ""]
    if skipped:
        lines += ["Left out: " + "; ".join(f"{SCRIPTS[m]} at n = {n} ({why})" for m, n, why in skipped) + ".", ""]
    lines += ["## Plots", ""] + [f"![{title}]({name})\n" for name, title in PLOTS if os.path.exists(os.path.join(out_dir, name))]
    failed = runs[runs["status"] != "ok"]
    lines += ["## Failed runs", ""] + (["None.", ""] if failed.empty else [])
    for _, row in failed.iterrows():
        lines += [f"### {row['run_id']}: {row['status']} ({row['error']})", "", f"Log: `{row['log_path']}`", "",
                  "```", str(row.get("log_tail", "") or "").strip(), "```", ""]
    lines += ["## Environment", "", markdown_table(pd.DataFrame(_env_rows(env), columns=["what", "value"]),
                                                   ["what", "value"]), ""]
    if env.get("nvidia_smi_topo"):
        lines += ["`nvidia-smi topo -m`:", "", "```", env["nvidia_smi_topo"], "```", ""]
    lines += ["## Commands", "", "The harness:", "", "```", harness_command, "```", "",
              "Each run (logs in `logs/`, metrics records in `metrics/`, every row in `runs.csv`):", "",
              "```"] + [f"# {r['run_id']} [{r['status']}]\n{r['command']}" for _, r in runs.iterrows()] + ["```", ""]
    write_text(os.path.join(out_dir, "report.md"), "\n".join(lines))


def _env_rows(env):
    keys = ["host", "cpu_model", "cpu_cores", "memory_bytes", "gpu_count", "gpu_names", "driver", "cuda", "cudnn",
            "nccl", "torch", "torchvision", "python", "platform", "git_commit", "git_dirty"]
    fmt = {"memory_bytes": lambda v: f"{v / 2**30:.1f} GiB", "gpu_names": lambda v: ", ".join(v) or "none"}
    return [(k, fmt.get(k, str)(env[k])) for k in keys if env.get(k) is not None]
