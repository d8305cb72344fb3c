"""The benchmark harness, run as a user runs it: `python bench/run_all.py ...` on the CPU with tiny settings."""
import json
import os
import subprocess
import sys
import uuid

import pandas as pd
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import report  # noqa: E402
import run_all  # noqa: E402
import sweep  # noqa: E402

TINY = ["--synthetic", "--max-steps", "8", "--test-batch-size", "1000"]  # 8 > the scripts' 5 warm-up steps
ALL_MODES = set(sweep.MODES)


def harness(*args, env=None, timeout=400):
    return subprocess.run([sys.executable, "bench/run_all.py", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def read_runs(out):
    return pd.read_csv(out / "runs.csv", keep_default_na=False, na_values=[""])


# ---- the sweep plan and the batch-size rules, without running anything

@pytest.mark.parametrize("max_n, counts", [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]), (6, [1, 2, 4, 6]),
                                           (8, [1, 2, 4, 8])])
def test_device_counts_are_one_then_powers_of_two_then_all(max_n, counts):
    assert sweep.gpu_counts(max_n) == counts


def gpu_settings(ids):
    return sweep.Settings(devices=ids, cpu_processes=2, per_gpu_batch=32, epochs=1, max_steps=0, test_batch_size=1000,
                          seed=1, synthetic=True, data_dir="data", target_acc=0.98, timeout=60, cores=16)


def test_gpu_commands_follow_the_batch_size_rules_and_choose_gpus_with_cuda_visible_devices():
    settings = gpu_settings(["4", "5", "6", "7"])
    runs = sweep.plan(settings, sweep.MODES, [("base", [])], repeats=1)
    assert [(r.mode, r.n) for r in runs] == [
        ("single", 1), ("dp", 1), ("ddp_launch", 1), ("ddp_spawn", 1),
        ("dp", 2), ("ddp_launch", 2), ("ddp_spawn", 2), ("ddp_multinode", 2),
        ("dp", 4), ("ddp_launch", 4), ("ddp_spawn", 4), ("ddp_multinode", 4)]
    for run in runs:
        cmds = sweep.commands(run, settings, "m.json")
        for env, argv in cmds:
            batch = int(argv[argv.index("--batch-size") + 1])
            assert batch == (run.n * 32 if run.mode == "dp" else 32), (run, argv)
            assert "--cpu" not in argv
        visible = [env["CUDA_VISIBLE_DEVICES"] for env, _ in cmds]
        if run.mode == "ddp_multinode":  # two nodes of n/2 GPUs each, one rendezvous port
            half = run.n // 2
            assert visible == [",".join(settings.devices[:half]), ",".join(settings.devices[half:run.n])]
            assert [argv[argv.index("-g") + 1] for _, argv in cmds] == [str(half)] * 2
            assert len({argv[argv.index("--master-port") + 1] for _, argv in cmds}) == 1
        else:
            assert visible == [",".join(settings.devices[:run.n])]
        if run.mode == "dp":  # ids after CUDA_VISIBLE_DEVICES renumbered them
            argv = cmds[0][1]
            assert argv[argv.index("--gpus") + 1] == ",".join(str(i) for i in range(run.n))
        if run.mode == "ddp_launch":
            assert cmds[0][1][1:4] == ["--standalone", "--nproc_per_node", str(run.n)]


def test_a_variant_repeats_the_sweep_with_its_flags_and_its_own_run_ids():
    settings = gpu_settings(["0", "1"])
    runs = sweep.plan(settings, ["single", "ddp_spawn"], [("base", []), ("amp", ["--amp"])], repeats=2)
    assert len(runs) == 2 * 2 * 3 and len({r.run_id for r in runs}) == len(runs)
    for run in runs:
        argv = sweep.commands(run, settings, "m.json")[0][1]
        assert ("--amp" in argv) == (run.variant == "amp")
        assert argv[argv.index("--seed") + 1] == str(run.repeat)  # each repeat its own seed


def test_variant_names_map_to_their_flags_and_add_to_the_named_flags_variants():
    variants = run_all.parse_variants(['lr2=--lr 2'], "amp, compile,amp+compile,amp")
    assert variants == [("base", []), ("amp", ["--amp"]), ("compile", ["--compile"]),
                        ("amp+compile", ["--amp", "--compile"]), ("lr2", ["--lr", "2"])]
    with pytest.raises(run_all.BadArgument, match="unknown variant fp8, bf8: choose from amp, compile"):
        run_all.parse_variants([], "amp,fp8,bf8")
    with pytest.raises(run_all.BadArgument, match="new name"):  # one name, one set of flags
        run_all.parse_variants(["amp=--amp"], "amp")


def hand_made_summary():
    """01 trains 1,000 samples/s with B = 64 (t1 = 64 ms); amp doubles 01 and DDP at n = 2 gains 2/3."""
    rows = [("base", "single", 1, 1000, 0.50), ("base", "dp", 1, 900, 0.50), ("base", "ddp_launch", 2, 1500, 0.50),
            ("base", "ddp_spawn", 4, 2000, 0.50),
            ("amp", "single", 1, 2000, 0.52), ("amp", "ddp_launch", 2, 2500, 0.49)]
    return pd.DataFrame([dict(variant=v, mode=m, n=n, per_device_batch=64, samples_per_s=float(x), test_accuracy=a)
                         for v, m, n, x, a in rows])


def test_limit_model_sets_each_run_against_compute_and_all_reduce_time():
    env = {"allreduce": {"2": {"gradient_row": {"time_us": 32000.0}}, "4": {"error": "exit code 1"}}}
    assert report.allreduce_seconds(env) == {2: pytest.approx(0.032)}
    limits = report.limit_model(hand_made_summary(), report.allreduce_seconds(env))
    limits = limits.set_index(["variant", "mode", "n"])
    assert set(limits.index) == {("base", "dp", 1), ("base", "ddp_launch", 2), ("base", "ddp_spawn", 4),
                                 ("amp", "ddp_launch", 2)}  # 01 itself is the model's input
    dp = limits.loc[("base", "dp", 1)]  # n = 1: no all-reduce, the limit is 01
    assert dp["x_overlap"] == dp["x_serial"] == pytest.approx(1000) and dp["pct_of_limit"] == pytest.approx(0.9)
    ddp = limits.loc[("base", "ddp_launch", 2)]  # t1 = 64 ms, t_ar = 32 ms
    assert (ddp["t1_ms"], ddp["t_ar_ms"]) == (pytest.approx(64), pytest.approx(32))
    assert ddp["x_serial"] == pytest.approx(2 * 64 / 0.096) and ddp["x_overlap"] == pytest.approx(2 * 64 / 0.064)
    assert ddp["pct_of_limit"] == pytest.approx(1500 / 2000)
    amp = limits.loc[("amp", "ddp_launch", 2)]  # the variant's own 01: t1 = 32 ms = t_ar
    assert amp["x_overlap"] == pytest.approx(4000) and amp["x_serial"] == pytest.approx(2000)
    assert pd.isna(limits.loc[("base", "ddp_spawn", 4), "x_overlap"])  # all-reduce failed: no limit, no guess


def test_variant_table_gives_speed_ratio_and_accuracy_change_per_mode_and_n():
    table = report.variant_table(hand_made_summary()).set_index(["variant", "mode", "n"])
    assert list(table.index) == [("amp", "single", 1), ("amp", "ddp_launch", 2)]
    assert table.loc[("amp", "single", 1), "ratio"] == pytest.approx(2.0)
    assert table.loc[("amp", "ddp_launch", 2), "base_samples_per_s"] == 1500
    assert table.loc[("amp", "ddp_launch", 2), "accuracy_diff"] == pytest.approx(-0.01)


def test_time_to_target_counts_training_time_until_the_first_epoch_at_target():
    epochs = [dict(train_time_s=10, test_accuracy=0.95), dict(train_time_s=9, test_accuracy=0.981),
              dict(train_time_s=8, test_accuracy=0.99)]
    assert sweep.time_to_target({"epochs_detail": epochs}, 0.98) == 19
    assert sweep.time_to_target({"epochs_detail": epochs}, 0.995) is None


# ---- bad arguments: one line on stderr, exit 2, nothing run

@pytest.mark.parametrize("args, message", [
    (["--modes", "single,pipeline"], "unknown mode pipeline"),
    (["--gpus", "99"], "GPU 99 does not exist"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--cpu", "0"], "--cpu must be at least 1"),
    (["--gpus", "0", "--cpu", "2"], "either --gpus or --cpu"),
    (["--per-gpu-batch", "x"], "invalid int value"),
    (["--variant", "nameless"], "--variant"),
    (["--variants", "amp,fp8"], "unknown variant fp8"),
])
def test_bad_arguments_give_one_line_and_exit_2(tmp_path, args, message):
    result = harness(*args, "--synthetic", "--out", tmp_path / "out", timeout=120)
    assert result.returncode == 2, result
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert not (tmp_path / "out" / "runs.csv").exists() and not (tmp_path / "out" / "logs").exists()


def test_unwritable_output_and_missing_data_are_refused_before_any_run(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = harness("--cpu", "1", "--synthetic", "--out", blocker / "out", timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "cannot create output folder" in result.stderr
    result = harness("--cpu", "1", "--data-dir", tmp_path / "empty", "--no-download", "--out", tmp_path / "o", timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "MNIST is not in" in result.stderr
    assert not (tmp_path / "o" / "runs.csv").exists()


# ---- one whole sweep, every mode, shared by the tests below

@pytest.fixture(scope="module")
def full_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "results"
    result = harness("--cpu", "2", *TINY, "--out", out)
    return result, out


@pytest.mark.slow
def test_sweep_runs_every_mode_and_finishes_cleanly(full_sweep):
    result, out = full_sweep
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    runs = read_runs(out)
    assert set(runs["mode"]) == ALL_MODES
    assert (runs["status"] == "ok").all(), runs[["run_id", "status", "error"]]
    assert sorted(zip(runs["mode"], runs["n"])) == sorted([
        ("single", 1), ("dp", 1), ("ddp_launch", 1), ("ddp_spawn", 1), ("ddp_launch", 2), ("ddp_spawn", 2),
        ("ddp_multinode", 2)])
    summary = pd.read_csv(out / "summary.csv")
    assert set(summary["mode"]) == ALL_MODES and len(summary) == len(runs)
    assert (runs["samples_per_s"] > 0).all()
    # progress: a start and an end line per run, numbered i/N
    assert [line.split(":")[0] for line in result.stdout.splitlines() if line.startswith("[")][:2] == \
        ["[1/7] single n=1 (processes)"] * 2


@pytest.mark.slow
def test_recorded_batches_follow_the_rules(full_sweep):
    _, out = full_sweep
    for _, row in read_runs(out).iterrows():
        record = json.loads((out / row["metrics_path"]).read_text())
        argv = record["argv"]
        loader_batch = int(argv[argv.index("--batch-size") + 1])
        assert record["global_batch"] == record["per_device_batch"] * record["world_size"], row["run_id"]
        assert row["global_batch"] == record["global_batch"] and row["world_size"] == record["world_size"]
        if row["mode"] == "dp":
            assert loader_batch == row["n"] * 64 == row["loader_batch"]
        else:
            assert loader_batch == 64 and record["world_size"] == row["n"], row["run_id"]
            assert record["global_batch"] == row["n"] * 64
        if row["mode"] == "ddp_multinode":
            assert record["nodes"] == 2


@pytest.mark.slow
def test_summary_compares_with_01_at_n_1(full_sweep):
    _, out = full_sweep
    summary = pd.read_csv(out / "summary.csv").set_index(["mode", "n"])
    base = summary.loc[("single", 1), "samples_per_s"]
    assert summary.loc[("single", 1), "efficiency"] == pytest.approx(1)
    for (mode, n), row in summary.iterrows():
        assert row["speedup"] == pytest.approx(row["samples_per_s"] / base)
        assert row["efficiency"] == pytest.approx(row["samples_per_s"] / (n * base))


@pytest.mark.slow
def test_sweep_writes_plots_report_environment_and_one_log_per_run(full_sweep):
    _, out = full_sweep
    for png in ("throughput.png", "efficiency.png", "time_to_target.png", "accuracy.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    report = (out / "report.md").read_text()
    for text in ["## Summary", "throughput.png", "## Environment", "## Commands", "torchrun --standalone",
                 "--nr 0", "--nr 1", "python bench/run_all.py --cpu 2"] + sorted(ALL_MODES):
        assert text in report, text
    env = json.loads((out / "env.json").read_text())
    for key in ("host", "cpu_model", "cpu_cores", "gpu_count", "torch", "cuda", "nccl", "harness_command"):
        assert key in env, key
    # the all-reduce of the gradient at n = 2, measured before the runs, and every DDP run against its limit
    allreduce = env["allreduce"]["2"]
    assert allreduce["backend"] == "gloo" and allreduce["world_size"] == 2, allreduce
    assert allreduce["gradient_row"]["bytes"] == 4_799_528 and allreduce["gradient_row"]["time_us"] > 0
    limits = report.split("## Limit model", 1)[1].split("\n## ", 1)[0]
    assert "% of the limit" in limits and "optimistic" in limits
    for mode in ("ddp_launch", "ddp_spawn", "ddp_multinode"):
        assert f"| {mode} | 2 |" in limits, mode
    runs = read_runs(out)
    assert all((out / path).stat().st_size > 0 for path in runs["log_path"])
    assert not [p for p in out.rglob("*") if ".tmp" in p.name], "a temporary file was left behind"


@pytest.mark.slow
def test_resume_of_a_finished_sweep_redoes_nothing(full_sweep):
    _, out = full_sweep
    before = read_runs(out)
    again = harness("--cpu", "2", *TINY, "--out", out, timeout=120)
    assert again.returncode == 2 and "--resume" in again.stderr  # finished results are never overwritten silently
    result = harness("--cpu", "2", *TINY, "--out", out, "--resume", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "7 runs planned, 7 already done (--resume), 0 to do" in result.stdout
    pd.testing.assert_frame_equal(read_runs(out), before)
    other = harness("--cpu", "2", *TINY[:-2], "--test-batch-size", "500", "--out", out, "--resume", timeout=120)
    assert other.returncode == 2 and "other settings (test_batch_size)" in other.stderr


# ---- failures: recorded, the sweep goes on, exit 1; --resume redoes only them

@pytest.mark.slow
def test_a_failing_run_does_not_stop_the_sweep_and_resume_redoes_only_it(tmp_path):
    out = tmp_path / "results"
    # BENCH_EXTRA_ARGS_<MODE> is the harness's documented way to add script flags; here one that 01 refuses.
    result = harness("--cpu", "1", "--modes", "single,dp", *TINY, "--out", out,
                     env={"BENCH_EXTRA_ARGS_SINGLE": "--test-batch-size 0"}, timeout=200)
    assert result.returncode == 1, result.stdout + result.stderr
    runs = read_runs(out).set_index("mode")
    assert runs.loc["single", "status"] == "failed" and runs.loc["single", "exit_code"] == 2
    assert "--test-batch-size must be positive" in runs.loc["single", "log_tail"]
    assert runs.loc["dp", "status"] == "ok"  # run after the failure
    assert "FAILED single-n1-r1" in result.stderr and "single-n1-r1" in (out / "report.md").read_text()
    dp_started = runs.loc["dp", "started_at"]

    result = harness("--cpu", "1", "--modes", "single,dp", *TINY, "--out", out, "--resume", timeout=200)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 runs planned, 1 already done (--resume), 1 to do" in result.stdout
    runs = read_runs(out).set_index("mode")
    assert (runs["status"] == "ok").all() and runs.loc["dp", "started_at"] == dp_started


@pytest.mark.slow
def test_a_run_past_its_timeout_is_killed_with_all_its_processes(tmp_path):
    marker = uuid.uuid4().hex  # inherited by every process the run starts, torchrun's workers too
    result = harness("--cpu", "1", "--modes", "ddp_launch", *TINY, "--timeout", "3", "--out", tmp_path / "r",
                     env={"BENCH_TEST_MARKER": marker}, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    row = read_runs(tmp_path / "r").iloc[0]
    assert row["status"] == "timeout" and "3 s timeout" in row["error"]
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and _has_marker(pid, marker)]


def _has_marker(pid, marker):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"BENCH_TEST_MARKER={marker}".encode() in f.read()
    except OSError:
        return False
