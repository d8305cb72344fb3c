"""summary.csv and report.md from runs.csv: the numbers and tables here, the prose in report_template.md."""
import math
import os
import pathlib
import re

import pandas as pd

from bench.outputs import read_json, write_atomically, write_text
from bench.plan import ideal_speedup
from bench.family import MODES, by_script

REFERENCE = next(name for name, mode in MODES.items() if mode.reference)  # 01: X(01)

BLOCKS = dict(re.findall(r"^<!-- (\w+) -->\n(.*?)\n*(?=^<!-- |\Z)",
                         pathlib.Path(__file__).with_name("report_template.md").read_text(), re.S | re.M))
KEYS = ["variant", "per_device_batch", "mode", "n"]
FIRSTS = ["world_size", "nodes", "global_batch", "loader_batch", "device_type"]
MEDIANS = ["samples_per_s", "time_to_target_s", "test_accuracy", "test_loss", "peak_memory_bytes", "wall_s"]
FORMATS = dict(speedup="{:.2f}x".format, speed_ratio="{:.2f}x".format, wall_ratio="{:.2f}x".format,
               bubble="{:.0%}".format, efficiency="{:.1%}".format, test_accuracy="{:.2%}".format,
               pct_of_limit="{:.0%}".format, accuracy_diff=lambda v: f"{100 * v:+.2f} pp",
               peak_memory_bytes=lambda v: f"{v / 2**20:.0f} MiB")
SUMMARY_VIEW = dict(variant="variant", mode="mode", n="n", runs="runs", world_size="world size",
                    global_batch="global batch", samples_per_s="samples/s", bubble="pipeline bubble",
                    speedup="speed-up vs 01", efficiency="efficiency E(n)", time_to_target_s="time to target (s)",
                    test_accuracy="test accuracy", peak_memory_bytes="peak memory", held_mib="held per rank (MiB)",
                    wall_s="wall (s)")
VERSUS_VIEW = dict(variant="variant", per_device_batch="per-GPU batch", mode="mode", n="n",
                   samples_per_s_ref="{} samples/s", samples_per_s="samples/s", speed_ratio="samples/s ratio",
                   wall_s_ref="{} wall (s)", wall_s="wall (s)", wall_ratio="wall-time ratio",
                   accuracy_diff="accuracy change")
RULES_VIEW = dict(script="script", mode="mode", rule="batch at n", exchanged="exchanged in a step")
LIMIT_VIEW = dict(variant="variant", mode="mode", n="n", per_device_batch="B", samples_per_s="measured samples/s",
                  t1_ms="t1 (ms)", t_ar_ms="t_ar (ms)", x_serial="X_serial", x_overlap="X_overlap",
                  pct_of_limit="% of the limit")


def bubble(stages, microbatches):
    """The share of a pipeline step each of p stages waits while m microbatches fill and drain it: GPipe and 1F1B."""
    return (stages - 1) / (microbatches + stages - 1)


def read_and_summarize(out_dir):
    runs = pd.read_csv(os.path.join(out_dir, "runs.csv"), keep_default_na=False, na_values=[""])
    records = [read_json(os.path.join(out_dir, path), {}) for path in runs["metrics_path"]]
    lasts = [(r.get("epochs_detail") or [r])[-1] for r in records]
    held = [last.get("bytes_per_rank") or [math.nan] for last in lasts]
    runs["held_mib"] = [max(each) / 2**20 for each in held]  # the fullest rank
    runs["bubble"] = [bubble(r["world_size"], last["microbatches"]) if "microbatches" in last else math.nan
                      for r, last in zip(records, lasts)]  # a pipeline's: one stage a rank
    per_run = runs.groupby(KEYS, as_index=False)[["held_mib", "bubble"]].max()
    summary = summarize(runs).merge(per_run, on=KEYS, how="left")
    write_atomically(os.path.join(out_dir, "summary.csv"), lambda tmp: summary.to_csv(tmp, index=False))
    return runs, summary


def with_01(frame, summary):
    """frame with x01: 01's samples/s at n = 1, same variant and per-device batch (NaN where it did not run)."""
    x01 = summary[(summary["mode"] == REFERENCE) & (summary["n"] == 1)]
    x01 = x01[["variant", "per_device_batch", "samples_per_s"]].rename(columns={"samples_per_s": "x01"})
    return frame.merge(x01, on=["variant", "per_device_batch"], how="left")


def shares_cores(frame):
    """Per row: whether its n processes share the cores 01 had to itself (CPU runs)."""
    return frame["device_type"] == "cpu"


def ideal_speedups(frame):
    return [ideal_speedup(n, shared) for n, shared in zip(frame["n"], shares_cores(frame))]


def summarize(runs):
    """Median of the ok runs per (variant, per-device batch, mode, n); E(n) = X(n) / (ideal speed-up x X(01))."""
    groups = runs[runs["status"] == "ok"].groupby(KEYS, sort=False)
    summary = groups[FIRSTS].first().join(groups[MEDIANS].median()).assign(runs=groups.size()).reset_index()
    summary = with_01(summary.reindex(columns=KEYS + ["runs"] + FIRSTS + MEDIANS), summary)
    summary["speedup"] = summary["samples_per_s"] / summary.pop("x01")
    summary["ideal_speedup"] = ideal_speedups(summary)
    summary["efficiency"] = summary["speedup"] / summary["ideal_speedup"]
    return summary.sort_values(["variant", "per_device_batch", "n", "mode"], ignore_index=True,
                               key=lambda c: c.map(list(MODES).index) if c.name == "mode" else c)


def versus(summary, chosen, reference, on):
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
    """Each multi-device row against its limit (the model is explained in the template's limit block)."""
    data_parallel = [name for name, mode in MODES.items()
                     if not mode.reference and not mode.batch.shared and mode.batch.shared_by == 1]
    rows = with_01(summary[summary["mode"].isin(data_parallel)], summary).dropna(subset=["x01"])
    per_device_batch, n = rows["per_device_batch"], rows["n"]
    t1 = n * per_device_batch / (ideal_speedups(rows) * rows["x01"])  # B / X(01) on GPUs, n B / X(01) on the CPU
    t_ar = n.map(lambda k: 0.0 if k == 1 else allreduce_s.get(k, math.nan))  # NaN: not measured, no limit
    rows["t1_ms"], rows["t_ar_ms"] = 1e3 * t1, 1e3 * t_ar
    rows["x_serial"] = n * per_device_batch / (t1 + t_ar)
    rows["x_overlap"] = n * per_device_batch / pd.concat([t1, t_ar], axis=1).max(axis=1, skipna=False)
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


def comparison(block, table, reference, hide, **values):
    view = {c: h.format(reference) for c, h in VERSUS_VIEW.items()}
    return [BLOCKS[block].format(table=markdown(table, view, hide), **values)] if len(table) else []


def comparisons(summary, settings, hide):
    blocks = []
    for name, mode in MODES.items():
        if mode.versus_parent:
            parent = summary["mode"] == by_script(mode.parent).name
            table = versus(summary, summary["mode"] == name, parent, ["variant", "per_device_batch", "n"])
            blocks += comparison(name, table, mode.parent[:2], hide | {"mode"})
    base = summary["variant"] == "base"
    table = versus(summary, ~base, base, ["per_device_batch", "mode", "n"])
    on_synthetic = BLOCKS["variants_on_synthetic"] if settings.synthetic else ""
    return blocks + comparison("variants", table, "base", hide - {"variant"}, on_synthetic=on_synthetic)


def limit_section(summary, env, settings, hide):
    table = limit_model(summary, allreduce_seconds(env))
    blocks = [BLOCKS["limit"].format(table=markdown(table, LIMIT_VIEW, hide))]
    blocks += [BLOCKS["allreduce_missing"].format(n=n, error=f["error"])
               for n, f in (env.get("allreduce") or {}).items() if f.get("error")]
    blocks += [BLOCKS[MODES[name].limit_note] for name in table.loc[table["n"] > 1, "mode"].unique()
               if MODES[name].limit_note]
    blocks += [BLOCKS["limit_cpu"].format(cores=settings.cores)] if settings.cpu else []
    return blocks if len(table) else []


def loader_line(env, summary):
    """The input pipeline alone (bench/measure/loader_speed.py) against this sweep's 01 at the same batch."""
    loader = env.get("loader") or {}
    if "loader_samples_per_s" not in loader:
        return BLOCKS["loader_missing"].format(error=loader.get("error"))
    speed, per_device_batch = loader["loader_samples_per_s"], loader["batch_size"]  # 01's --batch-size
    x01 = with_01(pd.DataFrame(dict(variant=["base"], per_device_batch=[per_device_batch])), summary)["x01"].iloc[0]
    versus_01 = BLOCKS["loader_versus_01"].format(ratio=speed / x01, x01=x01) if x01 > 0 else BLOCKS["loader_no_01"]
    return BLOCKS["loader"].format(**loader, per_device_batch=per_device_batch, speed=speed, versus_01=versus_01)


def batch_rules(summary):
    """The family table's batch rule and collectives of each mode in the summary, in reading order."""
    modes = [MODES[name] for name in MODES if name in set(summary["mode"])]
    return pd.DataFrame([dict(script=m.number, mode=m.name, rule=m.batch.says, exchanged=m.collectives or "nothing")
                         for m in modes], columns=list(RULES_VIEW))


def head(env, summary, settings):
    reference = BLOCKS["reference_shared_cores" if shares_cores(summary).any() else "reference_gpus"]
    shared = [name for name in MODES if MODES[name].batch.shared and name in set(summary["mode"])]
    notes = " ".join(BLOCKS[f"shared_{name}"] for name in shared)
    scripts = ", ".join(MODES[name].number for name in shared)
    reference += "\n\n" + BLOCKS["shared_batch"].format(scripts=scripts, notes=notes) if shared else ""
    groups = [MODES[name].number for name in MODES if MODES[name].batch.shared_by > 1 and name in set(summary["mode"])]
    reference += "\n\n" + BLOCKS["tp_groups"].format(scripts=", ".join(groups)) if groups else ""
    return BLOCKS["head"].format(
        hardware=env["hardware"], devices="processes" if settings.cpu else "GPUs", loader=loader_line(env, summary),
        reference=reference.format(cores=settings.cores),
        rules=markdown(batch_rules(summary), RULES_VIEW),
        per_device_batches=", ".join(map(str, settings.per_device_batches)), epochs=settings.epochs,
        images=f"{settings.epoch_images:,}" if settings.epoch_images else "all 60,000",
        test_batch_size=settings.test_batch_size, target_acc=settings.target_acc,
        data=BLOCKS["synthetic"] if settings.synthetic else BLOCKS["mnist"].format(data_dir=settings.data_dir))


def write_report(out_dir, runs, summary, env, settings, left_out, plots):
    hide = {c for c in ("variant", "per_device_batch") if summary[c].nunique() <= 1}
    pipelined = "bubble" in summary and summary["bubble"].notna().any()  # 10's rows: the bubble beside samples/s
    columns = hide if pipelined else hide | {"bubble"}
    blocks = [head(env, summary, settings)] + [BLOCKS["summary"].format(per_device_batch=b, table=markdown(
        summary[summary["per_device_batch"] == b], SUMMARY_VIEW, columns)) for b in settings.per_device_batches]
    blocks += [BLOCKS["pipeline_bubble"]] if pipelined else []
    blocks += [BLOCKS["left_out"].format(left_out="; ".join(left_out))] if left_out else []
    blocks += comparisons(summary, settings, hide) + limit_section(summary, env, settings, hide)
    images = [BLOCKS["plot"].format(name=name, title=title) for name, title in plots]
    failed = [BLOCKS["failed_run"].format(**{**row, "log_tail": str(row["log_tail"]).strip()})
              for _, row in runs[runs["status"] != "ok"].iterrows()]
    entries = [f"- {k}: {v}" for k, v in env.items()  # the short ones: versions, settings...
               if v not in (None, "") and len(str(v)) < 100 and "\n" not in str(v) and not isinstance(v, (dict, list))]
    busy = [f"- {row['run_id']}: {row['busy_before']}" for _, row in runs.iterrows()
            if isinstance(row.get("busy_before"), str) and row["busy_before"]]
    blocks += [BLOCKS["plots"].format(images="\n\n".join(images))]
    blocks += [BLOCKS["busy"].format(runs="\n".join(busy))] if busy else []
    blocks += [BLOCKS["failed"].format(runs="\n\n".join(failed or [BLOCKS["no_failures"]])),
               BLOCKS["environment"].format(entries="\n".join(entries))]
    blocks += [BLOCKS["topology"].format(**env)] if env.get("nvidia_smi_topo") else []
    commands = "\n".join(BLOCKS["command"].format(**row) for _, row in runs.iterrows())
    blocks += [BLOCKS["commands"].format(**env, commands=commands)]  # the harness's command and python too
    write_text(os.path.join(out_dir, "report.md"), "\n\n".join(blocks) + "\n")
