"""summary.csv and report.md from runs.csv: medians per (variant, batch, mode, n), speed-up and scaling
efficiency, 06 and 07 against 03, variants against the base sweep, and the limit model."""
import math
import os

import pandas as pd

from bench.files import write_atomically, write_text
from bench.scripts import LABELS, MODES, SCRIPTS

KEYS = ["variant", "batch", "mode", "n"]
FIRSTS = ["world_size", "nodes", "per_device_batch", "global_batch", "loader_batch"]
MEDIANS = ["samples_per_s", "time_to_target_s", "test_accuracy", "test_loss", "peak_memory_bytes", "wall_s"]
FORMATS = {"speedup": "{:.2f}x", "speed_ratio": "{:.2f}x", "wall_ratio": "{:.2f}x", "efficiency": "{:.1%}",
           "test_accuracy": "{:.2%}", "pct_of_limit": "{:.0%}", "accuracy_diff": "{:+.2%}"}
SUMMARY_VIEW = dict(variant="variant", mode="mode", n="n", runs="runs", world_size="world size",
                    global_batch="global batch", samples_per_s="samples/s", speedup="speed-up vs 01",
                    efficiency="efficiency E(n)", time_to_target_s="time to target (s)", test_accuracy="test accuracy",
                    peak_memory_bytes="peak memory", wall_s="wall (s)")
VERSUS_VIEW = dict(variant="variant", batch="per-GPU batch", mode="mode", n="n", samples_per_s_ref="{ref} samples/s",
                   samples_per_s="samples/s", speed_ratio="samples/s ratio", wall_s_ref="{ref} wall (s)",
                   wall_s="wall (s)", wall_ratio="wall-time ratio", accuracy_diff="accuracy change")
LIMIT_VIEW = dict(variant="variant", mode="mode", n="n", batch="B", samples_per_s="measured samples/s",
                  t1_ms="t1 (ms)", t_ar_ms="t_ar (ms)", x_serial="X_serial", x_overlap="X_overlap",
                  pct_of_limit="% of the limit")


def with_01(frame, summary):
    """frame with x01: the samples/s of 01 at n = 1 with the same variant and batch (NaN where it did not run)."""
    x01 = summary[(summary["mode"] == "single") & (summary["n"] == 1)][["variant", "batch", "samples_per_s"]]
    return frame.merge(x01.rename(columns={"samples_per_s": "x01"}), on=["variant", "batch"], how="left")


def summarize(runs):
    """Median of the ok runs per (variant, batch, mode, n); E(n) = X(n) / (n X(01 at n = 1))."""
    ok = runs[runs["status"] == "ok"]
    if ok.empty:
        return pd.DataFrame(columns=KEYS + ["runs"] + FIRSTS + MEDIANS + ["speedup", "efficiency"])
    groups = ok.groupby(KEYS, sort=False)
    summary = groups[FIRSTS].first().join(groups[MEDIANS].median(numeric_only=False))
    summary = summary.assign(runs=groups.size()).reset_index()
    summary = with_01(summary, summary)
    summary["speedup"] = summary["samples_per_s"] / summary.pop("x01")
    summary["efficiency"] = summary["speedup"] / summary["n"]
    return summary.sort_values(["variant", "batch", "n", "mode"], ignore_index=True,
                               key=lambda c: c.map(MODES.index) if c.name == "mode" else c)


def versus(summary, chosen, reference, on):
    """The rows chosen next to their reference rows (equal in the columns `on`): ratios of speed and wall time."""
    table = summary[chosen].merge(summary[reference][on + ["samples_per_s", "wall_s", "test_accuracy"]], on=on,
                                  suffixes=("", "_ref"))
    table["speed_ratio"] = table["samples_per_s"] / table["samples_per_s_ref"]
    table["wall_ratio"] = table["wall_s"] / table["wall_s_ref"]
    table["accuracy_diff"] = table["test_accuracy"] - table["test_accuracy_ref"]
    return table


def allreduce_seconds(env):
    """{n: seconds of one all-reduce of the model's gradient} from env.json (failed ones left out)."""
    figures = env.get("allreduce") or {}
    return {int(n): f["gradient_row"]["time_us"] * 1e-6 for n, f in figures.items() if f.get("gradient_row")}


def limit_model(summary, allreduce_s):
    """Each multi-device mode's row against its limit. Per step one device computes for t1 = B / X(01 at
    n = 1) (same variant and batch), then the gradients are all-reduced in t_ar(n) (0 at n = 1). Fully
    overlapped a step takes max(t1, t_ar), fully serial t1 + t_ar; n devices train n x B samples per step."""
    rows = with_01(summary[summary["mode"] != "single"], summary).dropna(subset=["x01"])
    batch, n = rows["batch"], rows["n"]
    t1 = batch / rows["x01"]
    t_ar = n.map(lambda k: 0.0 if k == 1 else allreduce_s.get(k, math.nan))  # NaN: not measured, no limit
    rows["t1_ms"], rows["t_ar_ms"] = 1e3 * t1, 1e3 * t_ar
    rows["x_serial"] = n * batch / (t1 + t_ar)
    rows["x_overlap"] = n * batch / pd.concat([t1, t_ar], axis=1).max(axis=1, skipna=False)
    rows["pct_of_limit"] = rows["samples_per_s"] / rows["x_overlap"]
    return rows.reset_index(drop=True)


def cell(value, column):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if column in FORMATS:
        return FORMATS[column].format(value).replace("%", " pp" if column == "accuracy_diff" else "%")
    if column == "peak_memory_bytes":
        return f"{value / 2**20:.0f} MiB"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
    return str(value).replace("|", "\\|")


def markdown(frame, view, hide=()):
    """A Markdown table of the view's columns ({column: header}) that the frame has, less those hidden."""
    columns = [c for c in view if c in frame and c not in hide]
    lines = ["| " + " | ".join(view[c] for c in columns) + " |", "|" + " --- |" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(row[c], c) for c in columns) + " |" for _, row in frame.iterrows()])


def read_runs(out_dir):
    return pd.read_csv(os.path.join(out_dir, "runs.csv"), keep_default_na=False, na_values=[""])


def write_summary(out_dir, runs):
    summary = summarize(runs)
    write_atomically(os.path.join(out_dir, "summary.csv"), lambda tmp: summary.to_csv(tmp, index=False))
    return summary


def versus_03_section(summary, mode, title, text, hide):
    table = versus(summary, summary["mode"] == mode, summary["mode"] == "ddp_launch", ["variant", "batch", "n"])
    if table.empty:
        return []
    view = {c: h.format(ref="03") for c, h in VERSUS_VIEW.items() if c not in ("mode", "accuracy_diff")}
    return [f"## {title}", "", text, "", markdown(table, view, hide), ""]


def variant_section(summary, settings, hide):
    table = versus(summary, summary["variant"] != "base", summary["variant"] == "base", ["batch", "mode", "n"])
    if table.empty:
        return []
    return ["## Variants against the base sweep", "",
            "Per mode, n and batch: samples/s and wall time of each variant against the base sweep, and the change "
            "in final test accuracy (percentage points)" + (": meaningless on --synthetic data." if settings.synthetic
                                                            else "."), "",
            markdown(table, {c: h.format(ref="base") for c, h in VERSUS_VIEW.items()}, hide - {"variant"}), ""]


def limit_section(summary, env, settings, hide):
    table = limit_model(summary, allreduce_seconds(env))
    if table.empty:
        return []
    lines = ["## Limit model", "",
             "Each multi-device run against a simple model of its limit. Per step one device computes for "
             "t1 = B / X(01 at n = 1) (this sweep's own 01), then the gradients are all-reduced in t_ar(n), measured "
             "before the sweep by bench/measure/allreduce.py at the model's gradient size (none at n = 1). Fully "
             "overlapped X_overlap(n) = n x B / max(t1, t_ar(n)); fully serial X_serial(n) = n x B / (t1 + t_ar(n)). "
             "'% of the limit' = measured / X_overlap.", "", markdown(table, LIMIT_VIEW, hide), ""]
    lines += [f"All-reduce at n = {n} not measured ({f['error']}): its limits are left out.\n"
              for n, f in (env.get("allreduce") or {}).items() if f.get("error")]
    if ((table["mode"] == "dp") & (table["n"] > 1)).any():
        lines += ["02 (DataParallel) has no all-reduce and is set against the same overlapped limit; it falls behind "
                  "because one process scatters every batch, replicates the model to each GPU every step and gathers "
                  "the outputs on GPU 0, all from one Python thread (the GIL).", ""]
    if settings.cpu:
        lines += [f"On the CPU t1 comes from 01 using all {settings.cores} cores, while each of the n processes gets "
                  "cores / n threads: this limit is optimistic.", ""]
    return lines


def loader_line(env, summary):
    """The input pipeline alone (bench/measure/loader_speed.py) against 01's training throughput in this sweep."""
    loader = env.get("loader") or {}
    if not loader.get("loader_samples_per_s"):
        return f"Loader alone: not measured ({loader.get('error', 'no figure')})."
    speed, batch = loader["loader_samples_per_s"], loader["batch_size"]
    line = f"Loader alone (bench/measure/loader_speed.py, batch {batch}): {speed:,.0f} samples/s"
    base = summary[(summary["mode"] == "single") & (summary["n"] == 1) & (summary["variant"] == "base")
                   & (summary["batch"] == batch)]
    if base.empty:
        return line + "; 01 did not run at that batch in this sweep, so there is no ratio."
    train = base["samples_per_s"].iloc[0]
    return line + f" = {speed / train:,.0f} x 01's training throughput ({train:,.0f} samples/s): the input " \
                  f"pipeline is not what this benchmark measures when that is at least {loader['required_ratio']}x."


ENVIRONMENT = ["host", "cpu_model", "cpu_cores", "memory_bytes", "gpus_used", "nvidia_driver_version",
               "cuda_runtime_version", "cudnn_version", "nccl_version", "matmul_allow_tf32", "cudnn_allow_tf32",
               "cudnn_benchmark", "cudnn_deterministic", "torch_version", "torchvision_version", "python_version",
               "os", "git_commit", "git_dirty"]


def write_report(out_dir, runs, summary, env, settings, left_out, plots, harness_command):
    """report.md: readable on its own: tables, plots, failed runs, the environment and every command."""
    unit, batches = ("processes" if settings.cpu else "GPUs"), ", ".join(map(str, settings.batches))
    hide = {c for c in ("variant", "batch") if summary[c].nunique() <= 1}
    lines = [f"# Multi-GPU MNIST benchmark: {env['hardware']}", "",
             f"n = number of {unit}; B = the per-GPU batch ({batches}). Batch-size rules: 01 trains with "
             f"--batch-size B; 02 gets --batch-size n x B and n GPUs (on the CPU it has no parallelism and runs at "
             f"n = 1 only); 03-07 get --batch-size B in each of n processes, so every multi-device mode has the "
             f"global batch n x B. Values are medians over the ok runs of each row; speed-up and "
             f"E(n) = X(n) / (n X(01)) compare with 01 at n = 1 with the same B.", "",
             f"Settings: {settings.epochs} epoch(s), " +
             (f"at most {settings.max_steps} steps per epoch, " if settings.max_steps else "full epochs, ") +
             f"test batch {settings.test_batch_size}, target accuracy {settings.target_acc:.2%}, " +
             ("**synthetic data** (throughput only: accuracy and time to target are meaningless)"
              if settings.synthetic else f"MNIST from {settings.data_dir}") + ".", "", loader_line(env, summary), ""]
    for batch in settings.batches:
        rows = summary[summary["batch"] == batch]
        lines += [f"## Summary: per-GPU batch {batch}", "",
                  markdown(rows, SUMMARY_VIEW, hide) if len(rows) else "No run finished.", ""]
    if left_out:
        lines += ["Left out: " + "; ".join(SCRIPTS[m] + (f" at n = {n}" if n else "") + f" ({why})"
                                           for m, n, why in left_out) + ".", ""]
    lines += versus_03_section(summary, "ddp_fault_tolerant", "Snapshot cost: 06 against 03",
                               "06 is 03 plus a snapshot of the whole training state every epoch: its samples/s and "
                               "the wall time of the whole command against 03's at the same n and batch.", hide)
    lines += versus_03_section(summary, "lightning", "Lightning overhead: 07 against 03",
                               "07 trains the same model with PyTorch Lightning's Trainer (strategy ddp): samples/s "
                               "ratio and wall-time ratio (the whole command, start-up included) against 03.", hide)
    lines += variant_section(summary, settings, hide) + limit_section(summary, env, settings, hide)
    lines += ["## Plots", ""] + [f"![{title}]({name})\n" for name, title in plots]
    failed = runs[runs["status"] != "ok"]
    lines += ["## Failed runs", ""] + (["None.", ""] if failed.empty else [])
    for _, row in failed.iterrows():
        lines += [f"### {row['run_id']}: {row['status']} ({row['error']})", "", f"Log: `{row['log_path']}`", "",
                  "```", str(row.get("log_tail", "") or "").strip(), "```", ""]
    shown = {k: env[k] for k in ENVIRONMENT if env.get(k) not in (None, "", [])}
    shown["memory_bytes"] = f"{shown['memory_bytes'] / 2**30:.1f} GiB"
    lines += ["## Environment (all of it in env.json)", "",
              markdown(pd.DataFrame(shown.items(), columns=["what", "value"]), dict(what="what", value="value")), ""]
    if env.get("nvidia_smi_topo"):
        lines += ["`nvidia-smi topo -m`:", "", "```", env["nvidia_smi_topo"], "```", ""]
    lines += ["## Commands", "", "The harness:", "", "```", harness_command, "```", "",
              f"Each run (python is {env['python']}, torchrun its `python -m torch.distributed.run`; logs in `logs/`, "
              "metrics records in `metrics/`, every row in `runs.csv`):", "",
              "```"] + [f"# {r['run_id']} [{r['status']}]\n{r['command']}" for _, r in runs.iterrows()] + ["```", ""]
    write_text(os.path.join(out_dir, "report.md"), "\n".join(lines))
