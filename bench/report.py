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
# What every process keeps on its device before it trains: MNIST's 60,000 + 10,000 images (float32) and labels
# (int64), in the scripts' MNIST class. Part of each peak; the summary shows the peak without it too.
MNIST_BYTES = (60000 + 10000) * (1 * 28 * 28 * 4 + 8)

BLOCKS = dict(re.findall(r"^<!-- (\w+) -->\n(.*?)\n*(?=^<!-- |\Z)",
                         pathlib.Path(__file__).with_name("report_template.md").read_text(), re.S | re.M))
KEYS = ["variant", "per_device_batch", "mode", "n"]
FIRSTS = ["world_size", "nodes", "global_batch", "loader_batch", "device_type"]
MEDIANS = ["samples_per_s", "time_to_target_s", "test_accuracy", "test_loss", "peak_memory_bytes", "wall_s"]
FORMATS = dict(dict.fromkeys(["speedup", "speed_ratio", "wall_ratio"], "{:.2f}x".format), bubble="{:.0%}".format,
               efficiency="{:.1%}".format, spread="{:.0%}".format, test_accuracy="{:.2%}".format,
               pct_of_limit="{:.0%}".format,
               accuracy_diff=lambda v: f"{100 * v:+.2f} pp",
               **dict.fromkeys(["peak_memory_bytes", "training_bytes"], lambda v: f"{v / 2**20:.0f} MiB"),
               in_bytes="{:,.0f}".format, out_bytes="{:,.0f}".format, predicted="{:.1%}".format)
SUMMARY_VIEW = dict(variant="variant", mode="mode", n="n", runs="runs", world_size="world size",
                    rule="global batch at n", global_batch="global batch", samples_per_s="samples/s",
                    bubble="pipeline bubble", spread="samples/s spread",
                    speedup="speed-up vs 01", efficiency="efficiency E(n)", time_to_target_s="time to target (s)",
                    test_accuracy="test accuracy", peak_memory_bytes="peak memory",
                    training_bytes="peak less MNIST", held_mib="held per rank (MiB)",
                    wall_s="wall (s)")
VERSUS_VIEW = dict(variant="variant", per_device_batch="per-GPU batch", mode="mode", n="n",
                   samples_per_s_ref="{} samples/s", samples_per_s="samples/s", speed_ratio="samples/s ratio",
                   wall_s_ref="{} wall (s)", wall_s="wall (s)", wall_ratio="wall-time ratio",
                   accuracy_diff="accuracy change")
PREDICTION_VIEW = dict(mode="mode", n="n", efficiency="measured E(n)", predicted="predicted E(n)")
ANATOMY_VIEW = dict(number="script", mode="mode", n="n", step_ms="step (ms)", compute_ms="compute",
                   overlapped_comm_ms="overlapped", exposed_comm_ms="exposed", idle_ms="idle",
                   in_bytes="bytes in", out_bytes="bytes out")
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
    runs["held_mib"] = [max(last.get("bytes_per_rank") or [math.nan]) / 2**20 for last in lasts]  # the fullest rank
    runs["bubble"] = [bubble(r["world_size"], last["microbatches"]) if "microbatches" in last else math.nan
                      for r, last in zip(records, lasts)]  # a pipeline's: one stage a rank
    per_run = runs.groupby(KEYS, as_index=False)[["held_mib", "bubble"]].max()
    summary = summarize(runs).merge(per_run, on=KEYS, how="left")
    write_atomically(os.path.join(out_dir, "summary.csv"), lambda tmp: summary.to_csv(tmp, index=False))
    return runs, summary


def with_01(frame, summary):
    """frame with x01: 01's samples/s at n = 1, same variant and per-device batch (NaN where it did not run)."""
    ones = summary[(summary["mode"] == REFERENCE) & (summary["n"] == 1)].rename(columns={"samples_per_s": "x01"})
    return frame.merge(ones[["variant", "per_device_batch", "x01"]], on=["variant", "per_device_batch"], how="left")


def shares_cores(frame):
    """Per row: whether its n processes share the cores 01 had to itself (CPU runs)."""
    return frame["device_type"] == "cpu"


def summarize(runs):
    """Median of the ok runs per (variant, per-device batch, mode, n); E(n) = X(n) / (ideal speed-up x X(01))."""
    groups = runs[runs["status"] == "ok"].groupby(KEYS, sort=False)
    summary = groups[FIRSTS].first().join(groups[MEDIANS].median()).assign(runs=groups.size()).reset_index()
    speeds = groups["samples_per_s"]  # the runs of a row apart: (fastest - slowest) / median, 0 for one run
    summary["spread"] = ((speeds.max() - speeds.min()) / speeds.median()).to_numpy()
    summary = with_01(summary.reindex(columns=KEYS + ["runs", "spread"] + FIRSTS + MEDIANS), summary)
    summary["speedup"] = summary["samples_per_s"] / summary.pop("x01")
    summary["ideal_speedup"] = list(map(ideal_speedup, summary["n"], shares_cores(summary)))
    summary["efficiency"] = summary["speedup"] / summary["ideal_speedup"]
    summary["rule"] = summary["mode"].map(lambda m: MODES[m].batch.short)
    summary["training_bytes"] = summary["peak_memory_bytes"] - MNIST_BYTES  # NaN on the CPU, as the peak
    return summary.sort_values(["variant", "per_device_batch", "n", "mode"], ignore_index=True,
                               key=lambda c: c.map(list(MODES).index) if c.name == "mode" else c)


def versus(summary, chosen, reference, on):
    table = summary[chosen].merge(summary[reference][on + ["samples_per_s", "wall_s", "test_accuracy"]], on=on,
                                  suffixes=("", "_ref"))
    return table.assign(speed_ratio=table["samples_per_s"] / table["samples_per_s_ref"],
                        wall_ratio=table["wall_s"] / table["wall_s_ref"],
                        accuracy_diff=table["test_accuracy"] - table["test_accuracy_ref"])


def allreduce_seconds(env):
    """{n: seconds of one all-reduce of the model's gradient} from env.json (failed ones left out)."""
    results = env.get("allreduce") or {}
    return {int(n): r["gradient_row"]["time_us"] * 1e-6 for n, r in results.items() if r.get("gradient_row")}


def limit_model(summary, allreduce_s):
    """Each data-parallel row against its limit (the template's limit block explains the model)."""
    data_parallel = [m.name for m in MODES.values() if not (m.reference or m.batch.shared or m.batch.shared_by > 1)]
    rows = with_01(summary[summary["mode"].isin(data_parallel)], summary).dropna(subset=["x01"])
    step = rows["global_batch"]  # samples a step, all devices: the record's, as trained
    t1 = step / (list(map(ideal_speedup, rows["n"], shares_cores(rows))) * rows["x01"])  # on the CPU n B / X(01)
    t_ar = rows["n"].map(lambda k: 0.0 if k == 1 else allreduce_s.get(k, math.nan))  # NaN: not measured, no limit
    return rows.assign(t1_ms=1e3 * t1, t_ar_ms=1e3 * t_ar, x_serial=step / (t1 + t_ar),
                       x_overlap=step / pd.concat([t1, t_ar], axis=1).max(axis=1, skipna=False),
                       pct_of_limit=lambda r: r["samples_per_s"] / r["x_overlap"]).reset_index(drop=True)


def cell(value, column):
    if pd.isna(value):
        return "-"
    if isinstance(value, float) and column not in FORMATS:
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
    return FORMATS.get(column, str)(value).replace("|", "\\|")  # a | would end the cell


def markdown(frame, view, hide=()):
    """A Markdown table of the view's columns ({column: header}) that the frame has, less those hidden."""
    columns = [c for c in view if c in frame and c not in hide]
    lines = ["| " + " | ".join(view[c] for c in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c], c) for c in columns) + " |" for _, row in frame.iterrows()]
    return "\n".join(lines)


def comparisons(summary, settings, hide):
    tables = [(name, versus(summary, summary["mode"] == name, summary["mode"] == by_script(mode.parent).name,
                            ["variant", "per_device_batch", "n"]), mode.parent[:2], hide | {"mode"})
              for name, mode in MODES.items() if mode.versus_parent]
    base = summary["variant"] == "base"
    tables.append(("variants", versus(summary, ~base, base, KEYS[1:]), "base", hide - {"variant"}))
    on_synthetic = BLOCKS["variants_on_synthetic"] if settings.synthetic else ""
    return [BLOCKS[block].format(table=markdown(table, {c: h.format(ref) for c, h in VERSUS_VIEW.items()}, hidden),
                                 on_synthetic=on_synthetic) for block, table, ref, hidden in tables if len(table)]


def loader_line(env, summary):
    """The input pipeline alone (bench/measure/loader_speed.py) against this sweep's 01 at the same batch."""
    loader = env.get("loader") or {}
    if "loader_samples_per_s" not in loader:
        return BLOCKS["loader_missing"].format(error=loader.get("error"))
    speed, per_device_batch = loader["loader_samples_per_s"], loader["batch_size"]  # 01's --batch-size
    x01 = with_01(pd.DataFrame(dict(variant=["base"], per_device_batch=[per_device_batch])), summary)["x01"].iloc[0]
    versus_01 = BLOCKS["loader_versus_01"].format(ratio=speed / x01, x01=x01) if x01 > 0 else BLOCKS["loader_no_01"]
    return BLOCKS["loader"].format(**loader, per_device_batch=per_device_batch, speed=speed, versus_01=versus_01)


def head(env, summary, settings):
    ran = [mode for name, mode in MODES.items() if name in set(summary["mode"])]  # in reading order
    rules = pd.DataFrame([dict(script=m.number, mode=m.name, rule=m.batch.says, exchanged=m.collectives or "nothing")
                          for m in ran], columns=list(RULES_VIEW))
    reference = BLOCKS["reference_shared_cores" if shares_cores(summary).any() else "reference_gpus"]
    shared = [m for m in ran if m.batch.shared]
    if shared:
        notes = " ".join(BLOCKS[f"shared_{m.name}"] for m in shared)
        reference += "\n\n" + BLOCKS["shared_batch"].format(scripts=", ".join(m.number for m in shared), notes=notes)
    groups = [m.number for m in ran if m.batch.shared_by > 1]
    reference += "\n\n" + BLOCKS["tp_groups"].format(scripts=", ".join(groups)) if groups else ""
    return BLOCKS["head"].format(
        hardware=env["hardware"], devices="processes" if settings.cpu else "GPUs", loader=loader_line(env, summary),
        reference=reference.format(cores=settings.cores), rules=markdown(rules, RULES_VIEW),
        per_device_batches=", ".join(map(str, settings.per_device_batches)), epochs=settings.epochs,
        images=f"{settings.epoch_images:,}" if settings.epoch_images else "all 60,000",
        test_batch_size=settings.test_batch_size, target_acc=settings.target_acc,
        data=BLOCKS["synthetic"] if settings.synthetic else BLOCKS["mnist"].format(data_dir=settings.data_dir))


def predicted(out_dir, summary, settings):
    """bench/measure/scaling.py's E(n) beside the measured E(n), for each modelled mode the anatomy has."""
    from bench.measure import scaling
    sweep = scaling.read_sweep(out_dir)
    if sweep is None or (not settings.cpu and "ddp_launch" not in sweep["anatomy"]):
        return []  # without 01's step, or on GPUs without DDP's compute, nothing to predict from
    on = dict(cores=settings.cores) if settings.cpu else dict(step_ms=sweep["t1_ms"])
    rows = [dict(mode=r["mode"], n=r["n"], efficiency=r["efficiency"], predicted=p["e_n"])
            for _, r in summary[summary["variant"] == "base"].iterrows() if r["mode"] in sweep["anatomy"]
            and r["mode"] in scaling.MODELLED and (p := scaling.predict(sweep, r["mode"], int(r["n"]), **on))]
    return [BLOCKS["prediction"].format(table=markdown(pd.DataFrame(rows), PREDICTION_VIEW))] if rows else []


def write_report(out_dir, runs, summary, env, settings, left_out, plots):
    hide = {c for c in ("variant", "per_device_batch") if summary[c].nunique() <= 1}
    pipelined = summary["bubble"].notna().any()  # 10's rows: the bubble beside samples/s
    blocks = [head(env, summary, settings)] + [BLOCKS["summary"].format(per_device_batch=b, table=markdown(
        summary[summary["per_device_batch"] == b], SUMMARY_VIEW, hide if pipelined else hide | {"bubble"}))
        for b in settings.per_device_batches]
    blocks += [BLOCKS["pipeline_bubble"]] if pipelined else []
    blocks += [BLOCKS["left_out"].format(left_out="; ".join(left_out))] if left_out else []
    blocks += comparisons(summary, settings, hide)
    limits = limit_model(summary, allreduce_seconds(env))
    if len(limits):
        blocks.append(BLOCKS["limit"].format(table=markdown(limits, LIMIT_VIEW, hide)))
        blocks += [BLOCKS["allreduce_missing"].format(n=n, error=f["error"])
                   for n, f in (env.get("allreduce") or {}).items() if f.get("error")]
        blocks += [BLOCKS[MODES[name].limit_note] for name in limits.loc[limits["n"] > 1, "mode"].unique()
                   if MODES[name].limit_note]
        blocks += [BLOCKS["limit_cpu"].format(cores=settings.cores)] if settings.cpu else []
    if env.get("anatomy"):  # run_all.py --anatomy
        blocks.append(BLOCKS["anatomy"].format(table=markdown(pd.DataFrame(env["anatomy"]), ANATOMY_VIEW)))
        blocks += predicted(out_dir, summary, settings)
    blocks.append(BLOCKS["plots"].format(images="\n\n".join(BLOCKS["plot"].format(name=name, title=title)
                                                            for name, title in plots)))
    busy = [f"- {row['run_id']}: {row['busy_before']}" for _, row in runs.iterrows()
            if isinstance(row.get("busy_before"), str)]  # NaN where the GPUs were free
    blocks += [BLOCKS["busy"].format(runs="\n".join(busy))] if busy else []
    failed = [BLOCKS["failed_run"].format(**{**row, "log_tail": str(row["log_tail"]).strip()})
              for _, row in runs[runs["status"] != "ok"].iterrows()]
    entries = [f"- {k}: {v}" for k, v in env.items()  # the short ones: versions, settings...
               if v not in (None, "") and len(str(v)) < 100 and "\n" not in str(v) and not isinstance(v, (dict, list))]
    blocks += [BLOCKS["failed"].format(runs="\n\n".join(failed or [BLOCKS["no_failures"]])),
               BLOCKS["environment"].format(entries="\n".join(entries))]
    blocks += [BLOCKS["topology"].format(**env)] if env.get("nvidia_smi_topo") else []
    commands = "\n".join(BLOCKS["command"].format(**row) for _, row in runs.iterrows())
    blocks += [BLOCKS["commands"].format(**env, commands=commands)]  # the harness's command and python too
    write_text(os.path.join(out_dir, "report.md"), "\n\n".join(blocks) + "\n")
