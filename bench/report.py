"""summary.csv and report.md from runs.csv: medians, E(n), 06 and 07 against 03, variants, the limit model."""
import math
import os

import pandas as pd

from bench.outputs import write_atomically, write_text
from bench.scripts import MODES

KEYS = ["variant", "batch", "mode", "n"]
FIRSTS = ["world_size", "nodes", "global_batch", "loader_batch"]
MEDIANS = ["samples_per_s", "time_to_target_s", "test_accuracy", "test_loss", "peak_memory_bytes", "wall_s"]
FORMATS = {"speedup": "{:.2f}x".format, "speed_ratio": "{:.2f}x".format, "wall_ratio": "{:.2f}x".format,
           "efficiency": "{:.1%}".format, "test_accuracy": "{:.2%}".format, "pct_of_limit": "{:.0%}".format,
           "accuracy_diff": lambda v: f"{100 * v:+.2f} pp", "peak_memory_bytes": lambda v: f"{v / 2**20:.0f} MiB"}
SUMMARY_VIEW = dict(variant="variant", mode="mode", n="n", runs="runs", world_size="world size",
                    global_batch="global batch", samples_per_s="samples/s", speedup="speed-up vs 01",
                    efficiency="efficiency E(n)", time_to_target_s="time to target (s)", test_accuracy="test accuracy",
                    peak_memory_bytes="peak memory", wall_s="wall (s)")
VERSUS_VIEW = dict(variant="variant", batch="per-GPU batch", mode="mode", n="n", samples_per_s_ref="{} samples/s",
                   samples_per_s="samples/s", speed_ratio="samples/s ratio", wall_s_ref="{} wall (s)",
                   wall_s="wall (s)", wall_ratio="wall-time ratio", accuracy_diff="accuracy change")
LIMIT_VIEW = dict(variant="variant", mode="mode", n="n", batch="B", samples_per_s="measured samples/s",
                  t1_ms="t1 (ms)", t_ar_ms="t_ar (ms)", x_serial="X_serial", x_overlap="X_overlap",
                  pct_of_limit="% of the limit")


def read_runs(out_dir):
    return pd.read_csv(os.path.join(out_dir, "runs.csv"), keep_default_na=False, na_values=[""])


def write_summary(out_dir, runs):
    summary = summarize(runs)
    write_atomically(os.path.join(out_dir, "summary.csv"), lambda tmp: summary.to_csv(tmp, index=False))
    return summary


def with_01(frame, summary):
    """frame with x01: the samples/s of 01 at n = 1 with the same variant and batch (NaN where it did not run)."""
    x01 = summary[(summary["mode"] == "single") & (summary["n"] == 1)][["variant", "batch", "samples_per_s"]]
    return frame.merge(x01.rename(columns={"samples_per_s": "x01"}), on=["variant", "batch"], how="left")


def summarize(runs):
    """Median of the ok runs per (variant, batch, mode, n); E(n) = X(n) / (n X(01 at n = 1))."""
    ok = runs[runs["status"] == "ok"]
    groups = ok.groupby(KEYS, sort=False)
    summary = groups[FIRSTS].first().join(groups[MEDIANS].median()).assign(runs=groups.size()).reset_index()
    summary = with_01(summary.reindex(columns=KEYS + ["runs"] + FIRSTS + MEDIANS), summary)
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
    results = env.get("allreduce") or {}
    return {int(n): r["gradient_row"]["time_us"] * 1e-6 for n, r in results.items() if r.get("gradient_row")}


def limit_model(summary, allreduce_s):
    """Each multi-device row against its limit (the model is explained in limit_section)."""
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
        return FORMATS[column](value)
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
    return str(value).replace("|", "\\|")


def markdown(frame, view, hide=()):
    """A Markdown table of the view's columns ({column: header}) that the frame has, less those hidden."""
    columns = [c for c in view if c in frame and c not in hide]
    lines = ["| " + " | ".join(view[c] for c in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c], c) for c in columns) + " |" for _, row in frame.iterrows()]
    return "\n".join(lines)


def comparison(title, text, table, reference, hide):
    view = {c: h.format(reference) for c, h in VERSUS_VIEW.items()}
    return [f"## {title}", "", text, "", markdown(table, view, hide), ""] if len(table) else []


def limit_section(summary, env, settings, hide):
    table = limit_model(summary, allreduce_seconds(env))
    lines = ["## Limit model", "",
             "Each multi-device run against a simple model of its limit: per step one device computes for t1 = B / "
             "X(01 at n = 1), then the gradient is all-reduced in t_ar(n) (measured before the sweep by "
             "bench/measure/allreduce.py; none at n = 1). Overlapped X_overlap(n) = n x B / max(t1, t_ar(n)); serial "
             "X_serial(n) = n x B / (t1 + t_ar(n)); '% of the limit' = measured / X_overlap.", "",
             markdown(table, LIMIT_VIEW, hide), ""]
    lines += [f"All-reduce at n = {n} not measured ({f['error']}): its limits are left out.\n"
              for n, f in (env.get("allreduce") or {}).items() if f.get("error")]
    if ((table["mode"] == "dp") & (table["n"] > 1)).any():
        lines += ["02 (DataParallel) has no all-reduce and is set against the same overlapped limit; it falls behind "
                  "because one process scatters every batch, replicates the model to each GPU every step and gathers "
                  "the outputs on GPU 0, all from one Python thread (the GIL).", ""]
    if settings.cpu:
        lines += [f"On the CPU t1 comes from 01 using all {settings.cores} cores, while each of the n processes gets "
                  "cores / n threads: this limit is optimistic.", ""]
    return lines if len(table) else []


def loader_line(env, summary):
    """The input pipeline alone (bench/measure/loader_speed.py) against this sweep's 01 at the same batch."""
    loader = env.get("loader") or {}
    if "loader_samples_per_s" not in loader:
        return f"Loader alone: not measured ({loader.get('error')})."
    speed, batch = loader["loader_samples_per_s"], loader["batch_size"]
    x01 = with_01(pd.DataFrame(dict(variant=["base"], batch=[batch])), summary)["x01"].iloc[0]
    ratio = f" = {speed / x01:,.0f} x 01's {x01:,.0f} samples/s" if x01 > 0 else " (01 did not run at that batch)"
    return f"Loader alone (bench/measure/loader_speed.py, batch {batch}): {speed:,.0f} samples/s{ratio}; the input " \
           f"pipeline is not what the benchmark measures if that is at least {loader['required_ratio']}x."


def write_report(out_dir, runs, summary, env, settings, left_out, plots, harness_command):
    """report.md: readable on its own: tables, plots, failed runs, the environment and every command."""
    hide = {c for c in ("variant", "batch") if summary[c].nunique() <= 1}
    data = "**synthetic data** (throughput only)" if settings.synthetic else f"MNIST from {settings.data_dir}"
    lines = [f"# Multi-GPU MNIST benchmark: {env['hardware']}", "",
             f"n = number of {'processes' if settings.cpu else 'GPUs'}; B = the per-GPU batch "
             f"({', '.join(map(str, settings.batches))}). 01 trains with --batch-size B; 02 gets n x B and n GPUs (on "
             "the CPU it has no parallelism: n = 1 only); 03-07 get B in each of n processes, so every multi-device "
             "mode has the global batch n x B. Values are medians of the ok runs; speed-up and E(n) = X(n) / (n X(01)) "
             "compare with 01 at n = 1 with the same B.", "",
             f"Settings: {settings.epochs} epoch(s) of {settings.max_steps or 'all'} steps, test batch "
             f"{settings.test_batch_size}, target accuracy {settings.target_acc:.2%}, {data}.", "",
             loader_line(env, summary), ""]
    for batch in settings.batches:
        rows = summary[summary["batch"] == batch]
        lines += [f"## Summary: per-GPU batch {batch}", "", markdown(rows, SUMMARY_VIEW, hide), ""]
    lines += ["Left out: " + "; ".join(left_out) + ".", ""] if left_out else []
    for mode, title, text in [
            ("ddp_fault_tolerant", "Snapshot cost: 06 against 03", "06 is 03 plus a snapshot of the training state "
             "every epoch; wall time: the whole command."),
            ("lightning", "Lightning overhead: 07 against 03", "07 is the same training in PyTorch Lightning's Trainer "
             "(strategy ddp); wall time: the whole command, start-up included.")]:
        table = versus(summary, summary["mode"] == mode, summary["mode"] == "ddp_launch", ["variant", "batch", "n"])
        lines += comparison(title, text, table, "03", hide | {"mode"})
    lines += comparison("Variants against the base sweep", "Same mode, n and batch; accuracy change in percentage "
                        "points" + (" (meaningless on synthetic data)." if settings.synthetic else "."),
                        versus(summary, summary["variant"] != "base", summary["variant"] == "base",
                               ["batch", "mode", "n"]), "base", hide - {"variant"})
    lines += limit_section(summary, env, settings, hide) + ["## Plots", ""]
    lines += [f"![{title}]({name})\n" for name, title in plots] + ["## Failed runs", ""]
    failed = runs[runs["status"] != "ok"]
    for _, row in failed.iterrows():
        lines += [f"### {row['run_id']}: {row['status']} ({row['error']})", "", f"Log: `{row['log_path']}`", "",
                  "```", str(row["log_tail"]).strip(), "```", ""]
    lines += (["None.", ""] if failed.empty else []) + ["## Environment (all of it in env.json)", ""]
    lines += [f"- {k}: {v}" for k, v in env.items() if v not in (None, "") and len(str(v)) < 100 and "\n" not in str(v)
              and not isinstance(v, (dict, list))] + [""]  # the short entries: versions, settings, hardware
    if env.get("nvidia_smi_topo"):
        lines += ["`nvidia-smi topo -m`:", "", "```", env["nvidia_smi_topo"], "```", ""]
    lines += ["## Commands", "", "The harness:", "", "```", harness_command, "```", "",
              f"Each run (python is {env['python']}, torchrun its `python -m torch.distributed.run`; logs in `logs/`, "
              "metrics records in `metrics/`, every row in `runs.csv`):", "",
              "```"] + [f"# {r['run_id']} [{r['status']}]\n{r['command']}" for _, r in runs.iterrows()] + ["```", ""]
    write_text(os.path.join(out_dir, "report.md"), "\n".join(lines))
