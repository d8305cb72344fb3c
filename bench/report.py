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
    if column in ("ratio", "speedup"):
        return f"{value:.2f}x"
    if column == "accuracy_diff":
        return f"{100 * value:+.2f} pp"
    if column == "pct_of_limit":
        return f"{value:.0%}"
    if column in ("efficiency", "test_accuracy"):
        return f"{value:.1%}" if column == "efficiency" else f"{value:.2%}"
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


VARIANT_VIEW = [("variant", "variant"), ("mode", "mode"), ("n", "n"), ("base_samples_per_s", "base samples/s"),
                ("samples_per_s", "variant samples/s"), ("ratio", "variant / base"),
                ("accuracy_diff", "accuracy: variant - base")]
LIMIT_VIEW = [("variant", "variant"), ("mode", "mode"), ("n", "n"), ("samples_per_s", "measured samples/s"),
              ("t1_ms", "t1 (ms)"), ("t_ar_ms", "t_ar (ms)"), ("x_serial", "X_serial"), ("x_overlap", "X_overlap"),
              ("pct_of_limit", "% of the limit")]
LIMITED_MODES = ["dp", "ddp_launch", "ddp_spawn", "ddp_multinode"]  # 01 is the model's input, not its subject


def variant_table(summary):
    """Per variant other than base and per (mode, n) that both ran: samples/s of each, ratio, accuracy change."""
    keys = ["mode", "n"]
    base = summary[summary["variant"] == "base"][keys + ["samples_per_s", "test_accuracy"]]
    other = summary[summary["variant"] != "base"][["variant"] + keys + ["samples_per_s", "test_accuracy"]]
    table = other.merge(base, on=keys, suffixes=("", "_base"))
    table = table.rename(columns={"samples_per_s_base": "base_samples_per_s"})
    table["ratio"] = table["samples_per_s"] / table["base_samples_per_s"]
    table["accuracy_diff"] = table["test_accuracy"] - table["test_accuracy_base"]
    return table[[c for c, _ in VARIANT_VIEW]]


def allreduce_seconds(env):
    """{n: seconds of one all-reduce of the model's gradient} from env.json's figures (failed ones left out)."""
    figures = env.get("allreduce") or {}
    return {int(n): f["gradient_row"]["time_us"] * 1e-6 for n, f in figures.items() if f.get("gradient_row")}


def limit_model(summary, allreduce_s):
    """Each dp/DDP row against its limit. Per step one device computes for t1 = B / X(01 at n=1) (the same
    variant's 01), then the gradients are all-reduced in t_ar(n) (0 at n = 1). Fully overlapped the step
    takes max(t1, t_ar), fully serial t1 + t_ar; n devices train n * B samples per step."""
    single = summary[(summary["mode"] == "single") & (summary["n"] == 1)].set_index("variant")["samples_per_s"]
    rows = summary[summary["mode"].isin(LIMITED_MODES) & summary["variant"].isin(single.index)].copy()
    batch, n = rows["per_device_batch"].astype(float), rows["n"]
    t1 = batch / rows["variant"].map(single)
    t_ar = n.map(lambda k: 0.0 if k == 1 else allreduce_s.get(k, math.nan))  # NaN: not measured, no limit
    rows["t1_ms"], rows["t_ar_ms"] = 1e3 * t1, 1e3 * t_ar
    rows["x_serial"] = n * batch / (t1 + t_ar)
    rows["x_overlap"] = n * batch / pd.concat([t1, t_ar], axis=1).max(axis=1, skipna=False)
    rows["pct_of_limit"] = rows["samples_per_s"] / rows["x_overlap"]
    return rows[[c for c, _ in LIMIT_VIEW]].reset_index(drop=True)


def _view(view, many_variants):
    """Columns and headers of a table; the variant column only when there is more than one."""
    chosen = [(c, h) for c, h in view if c != "variant" or many_variants]
    return [c for c, _ in chosen], [h for _, h in chosen]


def variant_section(summary, settings):
    table = variant_table(summary)
    if table.empty:
        return []
    lines = ["## Variants vs base", "",
             "What each variant buys, per mode and n: samples/s of the variant and of the base sweep (same mode, n "
             "and batches), their ratio, and the change in final test accuracy (percentage points).", ""]
    if settings.synthetic:
        lines += ["Accuracies on --synthetic data are meaningless (random images and labels): ignore that column.", ""]
    return lines + [markdown_table(table, *_view(VARIANT_VIEW, True)), ""]


def limit_section(summary, env, settings):
    table = limit_model(summary, allreduce_seconds(env))
    if table.empty:
        return []
    B = settings.per_gpu_batch
    lines = ["## Limit model", "",
             f"Each DataParallel and DDP run against a simple model of its limit. Per step one device computes for "
             f"t1 = {B} / X(01 at n = 1) (this sweep's own 01 median), then the gradients are all-reduced in "
             f"t_ar(n), measured before the sweep by bench/allreduce.py at the model's gradient size (none at "
             f"n = 1). Fully overlapped X_overlap(n) = n x {B} / max(t1, t_ar(n)); fully serial "
             f"X_serial(n) = n x {B} / (t1 + t_ar(n)). '% of the limit' = measured / X_overlap.", "",
             markdown_table(table, *_view(LIMIT_VIEW, table["variant"].nunique() > 1)), ""]
    for n, figure in sorted((env.get("allreduce") or {}).items(), key=lambda item: int(item[0])):
        if figure.get("error"):
            lines += [f"All-reduce at n = {n} not measured ({figure['error']}): its limits are left out.", ""]
    if ((table["mode"] == "dp") & (table["n"] > 1)).any():
        lines += ["02 (DataParallel) has no all-reduce and is set against the same overlapped limit; it falls "
                  "behind because one process scatters every batch, replicates the model to each GPU every step "
                  "and gathers the outputs on GPU 0, all from one Python thread (the GIL).", ""]
    if settings.cpu:
        lines += [f"On the CPU t1 comes from 01 using all {settings.cores} cores, while each of the n DDP processes "
                  f"gets cores / n threads: this limit is optimistic.", ""]
    return lines


def write_summary(out_dir, runs):
    summary = summarize(runs)
    write_csv(os.path.join(out_dir, "summary.csv"), summary)
    return summary


def write_report(out_dir, runs, summary, env, settings, skipped, harness_command):
    """report.md: readable on its own, with the table, the plots, the environment and every command."""
    cols, heads = _view(SUMMARY_VIEW, summary["variant"].nunique() > 1)
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
              if settings.synthetic else f"MNIST from {settings.data_dir}") + ".", "", loader_line(env, summary), "",
             "## Summary", "", markdown_table(summary, cols, heads) if len(summary) else "No run finished.", ""]
    if skipped:
        lines += ["Left out: " + "; ".join(f"{SCRIPTS[m]} at n = {n} ({why})" for m, n, why in skipped) + ".", ""]
    lines += variant_section(summary, settings) + limit_section(summary, env, settings)
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


def loader_line(env, summary):
    """The input pipeline alone (bench/loader_speed.py) against 01's training throughput in this sweep."""
    loader = env.get("loader") or {}
    if not loader.get("loader_samples_per_s"):
        return f"Loader alone: not measured ({loader.get('error', 'no figure')})."
    speed = loader["loader_samples_per_s"]
    line = f"Loader alone (bench/loader_speed.py, batch {loader['batch_size']}): {speed:,.0f} samples/s"
    base = summary[(summary["mode"] == "single") & (summary["n"] == 1) & (summary["variant"] == "base")]
    if base.empty or not base["samples_per_s"].iloc[0] > 0:
        return line + "; 01 did not run in this sweep, so there is no ratio."
    train = base["samples_per_s"].iloc[0]
    return line + f" = {speed / train:,.0f} x 01's training throughput ({train:,.0f} samples/s): the input " \
                  f"pipeline is not what this benchmark measures when that is at least {loader['required_ratio']}x."


def _env_rows(env):
    keys = ["host", "cpu_model", "cpu_cores", "memory_bytes", "gpu_count", "gpu_names", "driver", "cuda", "cudnn",
            "nccl", "torch", "torchvision", "python", "platform", "git_commit", "git_dirty"]
    fmt = {"memory_bytes": lambda v: f"{v / 2**30:.1f} GiB", "gpu_names": lambda v: ", ".join(v) or "none"}
    return [(k, fmt.get(k, str)(env[k])) for k in keys if env.get(k) is not None]
