"""The benchmark harness's planning, commands, report and progress, in this process: the batch-size rules, each
mode's command and its script's own parse_args, the efficiency and the limit model, the estimate against a
committed sweep (the sweep itself, run as a user runs it: tests/integration/test_bench_sweeps.py)."""
import dataclasses
import json
import math
import os
import signal
import sys
import time
import uuid

import pandas as pd
import pytest

from helpers import MODES, ROOT, TORCHRUN, gpu_settings, has_marker, load_script, read_runs, script_command, slack
from bench import doctor, flags, outputs, plan, plots, processes, report, run_all, sweep
from bench.commands import commands
from bench.processes import run_processes

AVAILABLE = [m for m in MODES if not plan.unavailable_reason(m)]  # 08 until it is written
TWO_ONLY = {"pipeline_parallel"}  # 10: two stages, so two processes only


# ---- the plan and the batch-size rules, without running anything

@pytest.mark.parametrize("max_n, counts", [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]), (6, [1, 2, 4, 6]),
                                           (8, [1, 2, 4, 8])])
def test_device_counts_are_one_then_powers_of_two_then_all(max_n, counts):
    assert plan.device_counts(max_n) == counts


def test_cpu_runs_share_the_cores_each_process_getting_cores_over_n_threads():
    """On the CPU the n processes of a run share the machine's cores: --threads cores // n (at least 1), each of
    05's two "nodes" on this host counted as n / 2 of the n processes, never the whole machine."""
    settings = dataclasses.replace(gpu_settings([]), max_n=4, cores=8)
    runs, _ = plan.plan(settings, MODES, [("base", [])], repeats=1)
    assert {r.n for r in runs} == {1, 2, 4}
    for run in runs:
        for _, argv in commands(run, settings, "m.json", "run/snapshot.pt"):
            assert argv[argv.index("--cpu") + 1:argv.index("--cpu") + 3] == ["--threads", str(8 // run.n)], argv
    few_cores = dataclasses.replace(settings, cores=2)  # 4 processes on 2 cores: one thread each, not 0
    _, argv = commands(next(r for r in runs if r.n == 4), few_cores, "m.json", "run/snapshot.pt")[0]
    assert argv[argv.index("--threads") + 1] == "1"


def test_gpu_commands_follow_the_batch_size_rules_and_use_the_harness_interpreter():
    settings = gpu_settings(["4", "5", "6", "7"])
    runs, _ = plan.plan(settings, MODES, [("base", [])], repeats=1)
    only = {"ddp_multinode": (2, 4), "fsdp_tp": (4,), "pipeline_parallel": (2,)}  # 05 needs 2 nodes, 11 4, 10 2
    assert [(r.mode, r.n) for r in runs] == [(m, n) for n in (1, 2, 4) for m in AVAILABLE
                                             if n in only.get(m, (1, 2, 4)) and (m, n) != ("single", 2)
                                             and (m, n) != ("single", 4)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    for run in runs:
        cmds = commands(run, settings, "m.json", "run/snapshot.pt")
        for env, argv in cmds:
            assert argv[0] == sys.executable, argv  # never `python` or `torchrun` from PATH
            assert int(argv[argv.index("--batch-size") + 1]) == (run.n * 32 if run.mode == "dp" else 32), argv
            assert "--cpu" not in argv
        visible = [env["CUDA_VISIBLE_DEVICES"] for env, _ in cmds]
        if run.mode == "ddp_multinode":  # two nodes of n/2 GPUs each, one rendezvous port
            half = run.n // 2
            assert visible == [",".join(settings.gpus[:half]), ",".join(settings.gpus[half:run.n])]
            assert [argv[argv.index("-g") + 1] for _, argv in cmds] == [str(half)] * 2
            assert len({argv[argv.index("--master-port") + 1] for _, argv in cmds}) == 1
        else:
            assert visible == [",".join(settings.gpus[:run.n])]
        argv = cmds[0][1]
        if run.mode == "dp":  # ids after CUDA_VISIBLE_DEVICES renumbered them
            assert argv[argv.index("--gpus") + 1] == ",".join(str(i) for i in range(run.n))
        if run.mode in ("ddp_launch", "ddp_fault_tolerant"):  # started alike; 06 with a snapshot of its own
            assert argv[:6] == torchrun + [str(run.n)]
            assert ("--snapshot" in argv) == (run.mode == "ddp_fault_tolerant")
        if run.mode == "lightning":
            assert argv[2:8] == ["--devices", str(run.n), "--strategy", "ddp", "--accelerator", "gpu"]


def test_the_tests_start_each_script_as_the_harness_does():
    """helpers' script_command reads the same table of modes: the same launcher and process count (05's
    nodes and the harness's own flags aside), 08 too before it exists; torchrun's options go before the script."""
    settings = gpu_settings(["0", "1"])
    for mode in MODES:
        argv = commands(plan.Run("base", (), mode, 2, 32, 1), settings, "m.json", "s.pt")[0][1]
        typed = script_command(MODES[mode].script, nprocs=2)
        assert typed == [str(ROOT / a) if a.endswith(".py") else a for a in argv[:len(typed)]], (mode, typed)
    assert script_command("03_ddp_launch.py", "--epochs", 1, nprocs=3, launcher=["--max-restarts", 0]) == [
        *TORCHRUN, "--standalone", "--nproc_per_node", "3", "--max-restarts", "0", str(ROOT / "03_ddp_launch.py"),
        "--epochs", "1"]
    assert script_command("04_ddp_spawn.py", "--nprocs", 2) == [sys.executable, str(ROOT / "04_ddp_spawn.py"),
                                                                "--nprocs", "2"]  # given by the caller: once


def test_each_per_gpu_batch_variant_and_repeat_is_a_run_of_its_own():
    settings = gpu_settings(["0", "1"], per_device_batches=(64, 512))
    runs, _ = plan.plan(settings, ["single", "ddp_spawn"], [("base", []), ("nodrop", ["--no-dropout"])], repeats=2)
    assert len(runs) == 2 * 2 * 2 * 3 and len({r.run_id for r in runs}) == len(runs)
    for run in runs:
        argv = commands(run, settings, "m.json", "s.pt")[0][1]
        assert ("--no-dropout" in argv) == (run.variant == "nodrop")
        assert argv[argv.index("--seed") + 1] == str(run.repeat)  # each repeat its own seed
        assert argv[argv.index("--batch-size") + 1] == str(run.per_device_batch)
        assert f"-b{run.per_device_batch}-" in run.run_id


def test_each_variant_is_a_name_and_its_script_flags_the_last_of_a_name_counting():
    args = run_all.parse_args(["--variant", "lr2=--lr 2", "--variant", "nodrop=--no-dropout --seed 3",
                               "--variant", "lr2=--lr 0.5"])
    assert args.variants == [("lr2", ["--lr", "0.5"]), ("nodrop", ["--no-dropout", "--seed", "3"])]


def hand_made_summary(device_type="cuda"):
    """01 trains 1,000 samples/s with B = 64 (t1 = 64 ms); variant "fast" doubles 01; its DDP at n = 2 gains 2/3."""
    rows = [("base", "single", 1, 1000, 0.50, 10), ("base", "dp", 1, 900, 0.50, 11),
            ("base", "ddp_launch", 2, 1500, 0.50, 12), ("base", "ddp_spawn", 4, 2000, 0.50, 13),
            ("base", "ddp_fault_tolerant", 2, 1200, 0.50, 18), ("base", "lightning", 2, 1000, 0.50, 24),
            ("fast", "single", 1, 2000, 0.52, 9), ("fast", "ddp_launch", 2, 2500, 0.49, 10)]
    return pd.DataFrame([dict(variant=v, per_device_batch=64, global_batch=64 * n, mode=m, n=n, samples_per_s=float(x),
                              test_accuracy=a, wall_s=float(w), device_type=device_type)
                         for v, m, n, x, a, w in rows])


def test_limit_model_sets_each_run_against_compute_and_all_reduce_time():
    env = {"allreduce": {"2": {"gradient_row": {"time_us": 32000.0}}, "4": {"error": "exit code 1"}}}
    assert report.allreduce_seconds(env) == {2: pytest.approx(0.032)}
    limits = report.limit_model(hand_made_summary(), report.allreduce_seconds(env)).set_index(["variant", "mode", "n"])
    assert ("base", "single", 1) not in limits.index  # 01 is the model's input, not its subject
    dp = limits.loc[("base", "dp", 1)]  # n = 1: no all-reduce, the limit is 01
    assert dp["x_overlap"] == dp["x_serial"] == pytest.approx(1000) and dp["pct_of_limit"] == pytest.approx(0.9)
    ddp = limits.loc[("base", "ddp_launch", 2)]  # t1 = 64 ms, t_ar = 32 ms
    assert (ddp["t1_ms"], ddp["t_ar_ms"]) == (pytest.approx(64), pytest.approx(32))
    assert ddp["x_serial"] == pytest.approx(2 * 64 / 0.096) and ddp["x_overlap"] == pytest.approx(2 * 64 / 0.064)
    assert ddp["pct_of_limit"] == pytest.approx(1500 / 2000)
    fast = limits.loc[("fast", "ddp_launch", 2)]  # the variant's own 01: t1 = 32 ms = t_ar
    assert fast["x_overlap"] == pytest.approx(4000) and fast["x_serial"] == pytest.approx(2000)
    assert pd.isna(limits.loc[("base", "ddp_spawn", 4), "x_overlap"])  # all-reduce failed: no limit, no guess


def test_06_and_07_are_set_against_03_and_variants_against_the_base_sweep():
    summary = hand_made_summary()
    table = report.versus(summary, summary["mode"].isin(["ddp_fault_tolerant", "lightning"]),
                          summary["mode"] == "ddp_launch", ["variant", "per_device_batch", "n"]).set_index("mode")
    assert table.loc["ddp_fault_tolerant", "speed_ratio"] == pytest.approx(1200 / 1500)
    assert table.loc["lightning", "wall_ratio"] == pytest.approx(2.0) and table.loc["lightning", "wall_s_ref"] == 12
    table = report.versus(summary, summary["variant"] != "base", summary["variant"] == "base",
                          ["per_device_batch", "mode", "n"]).set_index(["mode", "n"])
    assert list(table.index) == [("single", 1), ("ddp_launch", 2)]
    assert table.loc[("single", 1), "speed_ratio"] == pytest.approx(2.0)
    assert table.loc[("ddp_launch", 2), "accuracy_diff"] == pytest.approx(-0.01)


def test_efficiency_compares_each_batch_with_01_at_the_same_batch():
    rows = [(64, "single", 1, 1000), (64, "ddp_launch", 2, 1500),
            (512, "single", 1, 4000), (512, "ddp_launch", 2, 8000)]
    runs = pd.DataFrame([dict(variant="base", per_device_batch=b, mode=m, n=n, samples_per_s=float(x), status="ok")
                         for b, m, n, x in rows]).reindex(columns=outputs.COLUMNS)
    summary = report.summarize(runs).set_index(["per_device_batch", "mode"])
    assert summary.loc[(64, "ddp_launch"), "efficiency"] == pytest.approx(0.75)
    assert summary.loc[(512, "ddp_launch"), "efficiency"] == pytest.approx(1.0)


def one_01_and_ddp_at_2(device_type):
    """The issue's sweep on a quiet 2-core machine: 01 2,316 samples/s, DDP at n = 2 2,388 (one thread each)."""
    rows = [("single", 1, 2316.0), ("ddp_launch", 2, 2388.0)]
    runs = pd.DataFrame([dict(variant="base", per_device_batch=64, mode=m, n=n, samples_per_s=x, status="ok",
                              device_type=device_type) for m, n, x in rows])
    return report.summarize(runs.reindex(columns=outputs.COLUMNS)).set_index("mode")


def test_on_the_cpu_efficiency_compares_with_01_on_the_same_shared_cores():
    """n CPU processes share the cores 01 had alone: E(n) = X(n) / X(01) (103%, not 51%); n GPUs: X(n) / (n X(01))."""
    cpu, gpu = one_01_and_ddp_at_2("cpu"), one_01_and_ddp_at_2("cuda")
    assert cpu.loc["ddp_launch", "ideal_speedup"] == 1 and gpu.loc["ddp_launch", "ideal_speedup"] == 2
    assert cpu.loc["ddp_launch", "efficiency"] == pytest.approx(2388 / 2316)
    assert gpu.loc["ddp_launch", "efficiency"] == pytest.approx(2388 / (2 * 2316))
    assert cpu.loc["ddp_launch", "speedup"] == gpu.loc["ddp_launch", "speedup"] == pytest.approx(2388 / 2316)
    limits = report.limit_model(hand_made_summary("cpu"), {2: 0.032}).set_index(["variant", "mode", "n"])
    assert limits.loc[("base", "ddp_launch", 2), "t1_ms"] == pytest.approx(2 * 64)  # n x B on 01's 1,000/s
    assert limits.loc[("base", "ddp_launch", 2), "x_overlap"] == pytest.approx(1000)


@pytest.mark.parametrize("device_type, reference, title", [
    ("cpu", "1 x 01: n processes share 01's cores", "X(n) / X(01), n processes on 01's cores"),
    ("cuda", "n x 01", "X(n) / (n X(01))")])
def test_the_plots_ideal_line_and_the_reports_text_say_which_reference(monkeypatch, device_type, reference, title):
    """The ideal line of throughput.png is the summary's reference: flat at 01 on shared cores, n x 01 on GPUs."""
    drawn = {}
    monkeypatch.setattr(plots, "draw", lambda path, summary, column, title, *a, **options: drawn.setdefault(
        os.path.basename(path), (title, options)))
    summary = one_01_and_ddp_at_2(device_type).reset_index().assign(held_mib=float("nan"))
    settings = dataclasses.replace(gpu_settings(["0"] if device_type == "cuda" else []), max_n=2, cores=2)
    plots.write_all("out", summary, "a machine", settings)
    (label, line), = drawn["throughput.png"][1]["ideal"].items()
    assert label == f"ideal: {reference} [B=64]"
    assert line(2) == pytest.approx(2316 * (1 if device_type == "cpu" else 2))
    assert drawn["efficiency.png"][0].endswith(title)
    text = report.head(dict(hardware="a machine"), summary, settings)
    assert ("**On the CPU, E(n) = X(n) / X(01), not X(n) / (n X(01))**" in text) == (device_type == "cpu")
    assert ("E(n) = X(n) / (n X(01)): n GPUs" in text) == (device_type == "cuda")


def test_the_report_says_what_e_n_is_where_ranks_share_a_batch_and_leaves_them_out_of_the_limit_model():
    """09's n ranks train one batch B, 11's n / 2 pairs one B each: neither global batch is n x B, so the report's
    head says what their E(n) is, each only where it ran, and the limit model (n x B a step) leaves both out."""
    rule = MODES["fsdp_tp"].batch
    assert (rule.loader_batch(64, 8), rule.global_batch(64, 8)) == (64, 4 * 64)  # B per pair, 4 pairs
    rows = [("single", 1, 1000.0), ("ddp_launch", 4, 3000.0), ("tensor_parallel", 4, 1500.0), ("fsdp_tp", 4, 2500.0)]
    runs = pd.DataFrame([dict(variant="base", per_device_batch=64, mode=m, n=n, samples_per_s=x, status="ok",
                              device_type="cuda") for m, n, x in rows])
    summary = report.summarize(runs.reindex(columns=outputs.COLUMNS)).assign(held_mib=float("nan"))
    settings = dataclasses.replace(gpu_settings(["0", "1", "2", "3"]), max_n=4)
    text = report.head(dict(hardware="a machine"), summary, settings)
    assert "**09: n ranks, one batch.**" in text
    assert "**11: n / 2 pairs of ranks, each pair on one batch B.**" in text and "n / 2 x B, not n x B" in text
    assert "B per dp rank, shared by its 2 tensor-parallel ranks: n / 2 x B in all" in text  # the rules' table
    assert set(report.limit_model(summary, {4: 0.01})["mode"]) == {"ddp_launch"}
    without = report.head(dict(hardware="a machine"), summary[summary["mode"] != "fsdp_tp"], settings)
    assert "**09: n ranks" in without and "pairs of ranks" not in without
    # One axis, one 100% line: each line and each summary row says which global batch it trained.
    assert list(plots.labels(summary)) == ["01 single (global batch n x B)", "03 ddp_launch (global batch n x B)",
                                           "09 tensor_parallel (global batch B)", "11 fsdp_tp (global batch n/2 x B)"]
    assert list(summary["rule"]) == ["n x B", "n x B", "B", "n/2 x B"]
    assert "global batch at n" in report.SUMMARY_VIEW.values()
    data_parallel = summary[summary["mode"].isin(["single", "ddp_launch"])]
    assert list(plots.labels(data_parallel)) == ["01 single", "03 ddp_launch"]


@pytest.mark.parametrize("name", [name for name, mode in MODES.items() if mode.versus_parent])
def test_each_mode_set_against_its_parent_gets_its_section_in_the_report(name):
    """A sweep of 08 and 12 once wrote no report at all: 12 was set against 08, but the template had no section."""
    mode, parent = MODES[name], report.by_script(MODES[name].parent)
    rows = [(parent.name, 2, 1000.0), (name, 2, 900.0)]
    runs = pd.DataFrame([dict(variant="base", per_device_batch=64, mode=m, n=n, samples_per_s=x, status="ok",
                              device_type="cpu", wall_s=60.0) for m, n, x in rows])
    summary = report.summarize(runs.reindex(columns=outputs.COLUMNS))
    (section,) = report.comparisons(summary, gpu_settings([]), set())
    assert f"{mode.number} against {parent.number}" in section and "| 0.90" in section, section


def test_held_memory_per_rank_is_08s_fullest_rank_in_the_summary_and_memory_png(tmp_path, monkeypatch):
    """From runs.csv and the metrics records as a sweep leaves them: 08's ranks hold unequal shares (rows split
    unevenly), and the column, like the plot, is the fullest rank's, not their sum, nor the one of rank 0."""
    mib = 2**20
    held = {1: [40 * mib], 2: [19 * mib, 21 * mib], 3: [14 * mib, 13 * mib, 13 * mib]}  # together one copy
    (tmp_path / "metrics").mkdir()
    rows = []
    for mode, n in [("single", 1), ("ddp_launch", 2), ("fsdp", 1), ("fsdp", 2), ("fsdp", 3)]:
        run_id = f"{mode}-n{n}-b32-r1"
        record = dict(samples_per_s=1000.0 * n, world_size=n, **({"bytes_per_rank": held[n]} if mode == "fsdp" else {}))
        (tmp_path / "metrics" / f"{run_id}.json").write_text(json.dumps(record))
        rows.append(dict(run_id=run_id, variant="base", mode=mode, n=n, per_device_batch=32, repeat=1, status="ok",
                         world_size=n, nodes=1, device_type="cuda", samples_per_s=1000.0 * n,
                         metrics_path=f"metrics/{run_id}.json"))
    outputs.write_runs(str(tmp_path), rows)
    _, summary = report.read_and_summarize(str(tmp_path))
    by_run = summary.set_index(["mode", "n"])["held_mib"]
    assert by_run[("fsdp", 1)] == 40 and by_run[("fsdp", 2)] == 21 and by_run[("fsdp", 3)] == 14, by_run
    assert pd.isna(by_run[("ddp_launch", 2)]) and pd.isna(by_run[("single", 1)])  # 08's record alone has it
    drawn = {}
    monkeypatch.setattr(plots, "draw", lambda path, summary, column, *a, **options: drawn.setdefault(
        os.path.basename(path), (summary, column, options)))
    plots.write_all(str(tmp_path), summary, "a machine", gpu_settings(["0", "1", "2"]))
    plotted, column, options = drawn["memory.png"]
    points = plotted[plotted["mode"] == "fsdp"].set_index("n")[column]
    assert points.to_dict() == {1: 40, 2: 21, 3: 14}
    (line,) = options["ideal"].values()
    assert line(3) == 40  # DDP's whole copy: 08 at n = 1


def test_the_report_shows_the_pipeline_bubble_beside_10s_measured_throughput(tmp_path):
    """10's record names its microbatches m: its summary row gives (p - 1) / (m + p - 1) of p = 2 stages beside its
    samples/s (20% at m = 4, 11% at m = 8), the other rows none, and a report without 10 has no such column."""
    assert report.bubble(2, 4) == pytest.approx(0.2) and report.bubble(2, 1) == pytest.approx(0.5)
    (tmp_path / "metrics").mkdir()
    rows = []
    for variant, mode, n, microbatches in [("base", "single", 1, None), ("base", "tensor_parallel", 2, None),
                                           ("base", "pipeline_parallel", 2, 4), ("m8", "pipeline_parallel", 2, 8)]:
        run_id = f"{mode}-n{n}-b64-r1-{variant}"
        last = dict(bytes_per_rank=[301056, 18897056], microbatches=microbatches) if microbatches else {}
        record = dict(samples_per_s=1000.0 * n, world_size=n, epochs_detail=[dict(epoch=1, **last)])
        (tmp_path / "metrics" / f"{run_id}.json").write_text(json.dumps(record))
        rows.append(dict(run_id=run_id, variant=variant, mode=mode, n=n, per_device_batch=64, repeat=1, status="ok",
                         world_size=n, nodes=1, device_type="cuda", samples_per_s=1000.0 * n + 1,
                         metrics_path=f"metrics/{run_id}.json", command="python x.py"))
    outputs.write_runs(str(tmp_path), rows)
    env = dict(hardware="a machine", harness_command="python bench/run_all.py", python=sys.executable)
    frame, summary = report.read_and_summarize(str(tmp_path))
    report.write_report(str(tmp_path), frame, summary, env, gpu_settings(["0", "1"], per_device_batches=[64]), [], [])
    text = (tmp_path / "report.md").read_text()
    summary_table = text.split("## Summary")[1].split("\n\n")[1]
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in summary_table.splitlines()]
    columns = table[0]
    by_run = {(row[columns.index("variant")], row[columns.index("mode")]): row for row in table[2:]}
    bubble = columns.index("pipeline bubble")
    assert columns[bubble - 1] == "samples/s"  # beside the throughput it explains
    assert by_run["base", "pipeline_parallel"][bubble - 1:bubble + 1] == ["2,001", "20%"]
    assert by_run["m8", "pipeline_parallel"][bubble] == "11%"
    assert by_run["base", "tensor_parallel"][bubble] == by_run["base", "single"][bubble] == "-"
    assert "(p - 1) / (m + p - 1)" in text and "10's two ranks each hold a stage" in text
    without_10 = summary[summary["mode"] != "pipeline_parallel"]
    report.write_report(str(tmp_path), frame, without_10, env, gpu_settings(["0", "1"], per_device_batches=[64]),
                        [], [])
    text = (tmp_path / "report.md").read_text()
    assert "pipeline bubble" not in text and "(p - 1) / (m + p - 1)" not in text
    assert "09's ranks each hold a slice of fc1 and fc2" in text and "10's two ranks" not in text


def test_the_default_cpu_sweep_runs_each_mode_once_with_the_same_images_in_each_epoch(tmp_path, monkeypatch, capsys):
    """Without GPUs: 01 and 02 at n = 1, the process-group modes at n = 2 only (their n = 1 left out, saying why;
    --cpu 1 runs them); at n = 2 each epoch has half the steps of n = 1 at twice the batch: the same images."""
    monkeypatch.setattr(run_all.machine, "gpus", lambda: [])
    monkeypatch.setattr(run_all.machine, "cpu_cores", lambda: 2)
    assert run_all.main(["--dry-run", "--synthetic", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    planned = [line.split(":")[0].strip() for line in out.splitlines()
               if line.startswith("  ") and "left out" not in line]
    singles = [m for m in ("single", "dp") if m in AVAILABLE]
    at_2 = [m for m in AVAILABLE if m not in singles and MODES[m].runs_with(2, True)]  # 11 needs 4: never here
    assert planned == [f"{m}-n1-b64-r1" for m in singles] + [f"{m}-n2-b64-r1" for m in at_2]
    for mode in {m for m in AVAILABLE if MODES[m].runs_with(1, True)} - {"single", "dp"}:  # 05 needs 2, 11 4, 10 2
        assert f"left out: {MODES[mode].script} at n = 1 (a CPU sweep to n > 1" in out, mode
    for mode in TWO_ONLY & set(AVAILABLE):
        assert f"left out: {MODES[mode].script} at n = 1 ({MODES[mode].why})" in out, mode
    defaults = run_all.DEFAULTS["cpu"]
    for line in (line for line in out.splitlines() if "-b64-r1: " in line):
        n, argv = int(line.split("-n")[1].split("-")[0]), line.split()
        steps = int(argv[argv.index("--max-steps") + 1])
        mode = MODES[line.split(":")[0].strip().rsplit("-n", 1)[0]]
        assert steps * mode.batch.global_batch(64, n) == defaults["epoch_images"], line  # the same images at every n
    settings = dataclasses.replace(gpu_settings([]), max_n=1, **{k: defaults[k] for k in ("epochs", "epoch_images")})
    runs, _ = plan.plan(settings, MODES, [("base", [])], repeats=1)
    assert {r.mode for r in runs} == set(AVAILABLE) - {"ddp_multinode", "fsdp_tp"} - TWO_ONLY  # every mode at n = 1


def test_the_estimate_before_the_default_cpu_sweep_is_within_a_fifth_of_the_committed_sweeps_time():
    """results/cpu-2core-amd-epyc is the default CPU sweep of a quiet 2-core VM (the same runs, epochs and steps):
    the estimate that run_all prints before a sweep must agree with what that sweep took. The modes added since
    (09, 10, 11, 12) are left out of both: the default plan is that sweep's runs and theirs."""
    committed = read_runs(ROOT / "results" / "cpu-2core-amd-epyc").set_index("run_id")
    defaults = run_all.DEFAULTS["cpu"]
    settings = dataclasses.replace(gpu_settings([]), max_n=defaults["processes"], cores=2, per_device_batches=[64],
                                   synthetic=False, **{k: defaults[k] for k in ("epochs", "epoch_images")})
    swept = [name for name in MODES if name in set(committed["mode"])]
    left = {"tensor_parallel", "pipeline_parallel", "fsdp_tp", "fsdp_big"}
    assert set(MODES) - set(swept) == left, "a mode without a committed CPU sweep"
    runs, _ = plan.plan(settings, swept, [("base", [])], repeats=1)
    assert sorted(r.run_id for r in runs) == sorted(committed.index)
    for run in runs:
        assert committed.loc[run.run_id, "steps"] == settings.epochs * plan.steps_per_epoch(run, settings), run
    estimate = sum(plan.estimate_s(run, settings) for run in runs)
    assert 0.8 < estimate / committed["wall_s"].sum() < 1.25, (estimate, committed["wall_s"].sum())


def test_the_time_left_during_a_sweep_is_the_estimates_left_at_the_pace_of_the_runs_done(tmp_path, monkeypatch,
                                                                                        capsys):
    """This machine took twice its estimates: the time left is twice the estimates left, whatever the runs' sizes
    (the n = 2 runs of a CPU sweep train as many images as 01, with twice the processes to start)."""
    settings = dataclasses.replace(gpu_settings([]), max_n=2, epochs=3, epoch_images=300 * 64, cores=2)
    runs, _ = plan.plan(settings, ["single", "ddp_launch", "ddp_spawn"], [("base", [])], repeats=1)
    runs = runs + [dataclasses.replace(runs[-1], per_device_batch=512)]  # a run of another size
    clock = [0.0]
    monkeypatch.setattr(sweep.time, "monotonic", lambda: clock[0])

    def twice_its_estimate(run, settings, out_dir):
        clock[0] += 2 * plan.estimate_s(run, settings)
        return dict(dataclasses.asdict(run), run_id=run.run_id, status="ok", samples_per_s=1, test_accuracy=1)
    monkeypatch.setattr(sweep, "run_one", twice_its_estimate)
    monkeypatch.setattr(sweep, "write_runs", lambda out_dir, rows: None)
    sweep.run_plan(runs, {}, settings, str(tmp_path), {})
    said = [line.split("about ")[1].split(" left")[0] for line in capsys.readouterr().out.splitlines() if "left" in line]
    estimates = [plan.estimate_s(run, settings) for run in runs]
    assert said == [str(sweep.timedelta(seconds=round(2 * sum(estimates[i:])))) for i in range(1, len(runs))]


def test_a_gpu_sweep_counts_a_run_that_trained_on_the_cpu_as_failed():
    settings = gpu_settings(["0"])
    assert sweep.status(0, False, {"device_type": "cuda"}, settings, 600) == ("ok", "")
    state, error = sweep.status(0, False, {"device_type": "cpu"}, settings, 600)
    assert state == "failed" and "trained on cpu, not on a GPU" in error
    assert sweep.status(0, False, {"device_type": "cpu"}, dataclasses.replace(settings, gpus=[]), 600)[0] == "ok"


def test_time_to_target_counts_training_time_until_the_first_epoch_at_target():
    epochs = [dict(train_time_s=10, test_accuracy=0.95), dict(train_time_s=9, test_accuracy=0.981),
              dict(train_time_s=8, test_accuracy=0.99)]
    assert sweep.time_to_target({"epochs_detail": epochs}, 0.98) == 19
    assert sweep.time_to_target({"epochs_detail": epochs}, 0.995) is None


@pytest.mark.parametrize("settings", [gpu_settings(["0", "1", "2", "3"]), dataclasses.replace(
    gpu_settings([]), max_n=2, synthetic=False, epoch_images=6 * 64)], ids=["4 GPUs", "2 CPU processes"])
def test_every_script_accepts_the_commands_the_harness_gives_it(settings, tmp_path):
    """Each planned command's script flags, parsed by that script's own parse_args (the sweep below runs some
    of the modes for real; tests/integration/test_each_mode_runs.py trains every mode as a user starts it)."""
    runs, _ = plan.plan(settings, MODES, [("base", [])], repeats=1)
    assert {run.mode for run in runs} == set(AVAILABLE) - ({"fsdp_tp"} if settings.max_n < 4 else set())  # 11: 4
    for run in runs:
        for _, argv in commands(run, settings, tmp_path / "m.json", tmp_path / "s.pt"):
            script = next(arg for arg in argv if arg.endswith(".py"))
            args = load_script(script).parse_args(argv[argv.index(script) + 1:])
            assert args.batch_size == run.per_device_batch * (run.n if run.mode == "dp" else 1), argv


def test_the_harness_keeps_the_record_a_run_wrote_and_gives_it_the_whole_command(tmp_path):
    """A script writes its record whole (test_each_mode_runs checks its keys); the sweep only replaces argv,
    which saw the script's own arguments, with the launch it made: torchrun and its flags included."""
    settings = dataclasses.replace(gpu_settings([]), max_n=2, synthetic=True, epoch_images=6 * 64)
    runs, _ = plan.plan(settings, MODES, [("base", [])], repeats=1)
    run = next(r for r in runs if r.mode == "ddp_launch" and r.n == 2)
    (_, argv), = commands(run, settings, tmp_path / "m.json", tmp_path / "s.pt")
    written = {"mode": "ddp_launch", "lr": 0.5, "argv": ["03_ddp_launch.py", "--lr", "0.5"]}
    assert sweep.completed(written, argv) == {**written, "argv": argv} and "torch.distributed.run" in argv


def test_a_fresh_clone_sweeps_beside_the_results_it_ships(tmp_path, monkeypatch, capsys):
    """A clone whose results/ already holds a sweep with this machine's own label: the main job and its dry run
    start (exit 0), in <label>-2, and leave the shipped sweep as it was; --resume goes back to the newest."""
    label = run_all.machine.machine_tag([])
    shipped = tmp_path / label
    shipped.mkdir()
    (shipped / "runs.csv").write_text("the repository's own sweep\n")
    monkeypatch.setattr(run_all, "RESULTS", str(tmp_path))
    assert run_all.main(["--cpu", "1", "--modes", "single", "--synthetic", "--dry-run"]) == 0
    assert f"results in {tmp_path / (label + '-2')}" in capsys.readouterr().out
    assert run_all.default_out(label, resume=True) == str(shipped)
    (tmp_path / f"{label}-2").mkdir()
    (tmp_path / f"{label}-2" / "runs.csv").write_text("a sweep of the user's\n")
    assert run_all.default_out(label, resume=False) == str(tmp_path / f"{label}-3")
    assert run_all.default_out(label, resume=True) == str(tmp_path / f"{label}-2")
    assert (shipped / "runs.csv").read_text() == "the repository's own sweep\n"


@pytest.mark.parametrize("program", [run_all, doctor], ids=["run_all", "doctor"])
def test_every_number_flag_of_the_harness_and_the_doctor_is_refused_out_of_range_as_it_is_read(program):
    """The class, not the cases: each number flag has a bounded type of bench/flags.py (a bare int or float takes
    0, -1 and NaN), and each bound holds: NaN, infinity, a word and a value past either end give one line."""
    numbers = [a for a in program.parser()._actions if a.type is not None and a.option_strings]
    assert not [a.dest for a in numbers if a.type in (int, float)], "a number flag without bounds"
    for action in [a for a in numbers if hasattr(a.type, "bounds")]:
        low, high = action.type.bounds
        flag = action.option_strings[-1]
        for bad in ["nan", "inf", "-inf", "x", str(low - 1)] + ([str(high + 1)] if high < math.inf else []):
            with pytest.raises(flags.BadArgument, match=f"^argument {flag}: (must be|expected)"):
                program.parse_args([flag, bad])
        assert program.parse_args([flag, str(low)]) is not None  # the bound itself is taken


def test_a_run_deaf_to_sigterm_is_killed_and_reaped_before_run_processes_returns(tmp_path):
    """Its exit code is read and it is gone, not still dying while the caller looks for leftovers."""
    deaf = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"]
    code, timed_out = run_processes([({}, deaf)], [tmp_path / "run.log"], timeout=1, grace=0.5)
    assert timed_out and code == -signal.SIGKILL, (code, timed_out)


def test_a_run_past_its_timeout_is_stopped_with_every_process_of_its_group(tmp_path):
    """In-process: a command whose parent does not pass a signal on (a shell, its two children). torchrun and
    04's parent end their own workers, so only a signal to the whole process group shows in this one."""
    marker = uuid.uuid4().hex
    command = ({"BENCH_TEST_MARKER": marker}, ["sh", "-c", "sleep 300 & sleep 300"])
    try:
        code, timed_out = run_processes([command], [tmp_path / "run.log"], timeout=1)
        assert timed_out and code != 0, (code, timed_out)
        deadline = time.monotonic() + 5  # a signal is delivered, and /proc cleared, a moment after kill() returns
        while (left := [pid for pid in os.listdir("/proc") if pid.isdigit() and has_marker(pid, marker)]) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"processes of the stopped run still running 5 s after it was stopped: {left}"
    finally:
        for pid in [pid for pid in os.listdir("/proc") if pid.isdigit() and has_marker(pid, marker)]:
            os.kill(int(pid), 9)


@pytest.mark.parametrize("epoch_images", [100, 1000, 19200, 60001])
def test_an_epoch_that_the_global_batch_does_not_divide_gets_one_step_more_not_one_less(epoch_images):
    """Every run's epoch holds at least epoch_images images, and less than one global batch more: rounded down,
    a run at a large global batch would train on fewer images than 01 and reach its target later."""
    settings = dataclasses.replace(gpu_settings(["0", "1", "2", "3"], per_device_batches=(64, 96)),
                                   epoch_images=epoch_images)
    runs, _ = plan.plan(settings, MODES, [("base", [])], repeats=1)
    assert runs
    for run in runs:
        steps, batch = plan.steps_per_epoch(run, settings), plan.global_batch(run)
        assert (steps - 1) * batch < epoch_images <= steps * batch, (run, steps, batch)


def test_a_node_that_failed_leaves_its_peer_peer_grace_s_not_the_whole_timeout(tmp_path, monkeypatch):
    """05's two nodes: once one has failed, the other would only wait for a rendezvous that never comes. It gets
    PEER_GRACE_S (15 s; 1 s here), then it is stopped, and the failed node's exit code is the run's."""
    monkeypatch.setattr(processes, "PEER_GRACE_S", 1)
    failed = ({}, [sys.executable, "-c", "import sys; sys.exit(3)"])
    waits = ({}, [sys.executable, "-c", "import time; time.sleep(300)"])
    started = time.monotonic()
    code, timed_out = run_processes([failed, waits], [tmp_path / "node0.log", tmp_path / "node1.log"], timeout=120)
    took = time.monotonic() - started
    assert (code, timed_out) == (3, False) and took < slack(1 + processes.KILL_GRACE_S + 3), (code, timed_out, took)


def test_the_summary_shows_the_peak_and_the_peak_less_the_mnist_each_process_keeps_on_its_device():
    """01's peak on the H200 was 332 MiB, of which MNIST's tensors were 210: training took 122 MiB, not 332."""
    runs = pd.DataFrame([dict(variant="base", per_device_batch=64, mode="single", n=1, samples_per_s=1.0,
                              status="ok", device_type="cuda", peak_memory_bytes=332 * 2**20)])
    summary = report.summarize(runs.reindex(columns=outputs.COLUMNS))
    assert report.MNIST_BYTES == 220_080_000
    assert summary.loc[0, "training_bytes"] == 332 * 2**20 - report.MNIST_BYTES
    assert "| 332 MiB | 122 MiB |" in report.markdown(summary, report.SUMMARY_VIEW)


def test_a_gpu_sweep_repeats_each_run_three_times_and_the_summary_gives_the_median_and_spread(monkeypatch):
    """A GPU run's steady window can be under a second: one try is not a figure. The CPU default stays one."""
    monkeypatch.setattr(run_all, "chosen_gpus", lambda args: [(0, "H200"), (1, "H200")])
    planned = {}
    monkeypatch.setattr(plan, "plan", lambda settings, modes, variants, repeats: planned.setdefault("k", repeats)
                        and ([], ["stop here"]))
    assert run_all.main(["--modes", "single", "--dry-run"]) == 2 and planned["k"] == 3
    rows = [dict(variant="base", per_device_batch=64, mode="single", n=1, samples_per_s=x, status="ok",
                 device_type="cuda") for x in (900.0, 1000.0, 1200.0)]
    (summary,) = [report.summarize(pd.DataFrame(rows).reindex(columns=outputs.COLUMNS)).iloc[0]]
    assert (summary["runs"], summary["samples_per_s"], summary["spread"]) == (3, 1000.0, pytest.approx(0.3))
    assert run_all.DEFAULTS["cpu"]["repeats"] == 1
