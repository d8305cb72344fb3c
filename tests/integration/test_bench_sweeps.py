"""The benchmark harness, run as a user runs it: `python bench/run_all.py ...` on the CPU with tiny settings."""
import json
import os
import stat
import sys
import uuid

import pandas as pd
import pytest

from helpers import TINY, TINY_BATCH as B, harness, has_marker, read_runs


def executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture(scope="module")
def fake_machine(tmp_path_factory):
    """PATH with an nvidia-smi that lists 8 GPUs, and a `python` and `torchrun` that fail: the harness must
    start every run with its own interpreter, never with whatever `python` comes first on PATH."""
    bin_dir = tmp_path_factory.mktemp("bin")
    gpus = "".join(f"echo '{i}, GPU-{i:04d}, NVIDIA H200'\n" for i in range(8))
    executable(bin_dir / "nvidia-smi", f"#!/bin/sh\n[ \"$1\" = topo ] && exit 1\n{gpus}")
    for name in ("python", "torchrun"):
        executable(bin_dir / name, f"#!/bin/sh\necho 'the {name} on PATH ran' >&2\nexit 97\n")
    # A CUDA_VISIBLE_DEVICES of the real machine (SLURM and many clouds set one) would choose among its GPUs.
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": None}


# ---- the GPUs a dry run chooses

def test_cuda_visible_devices_set_by_the_user_chooses_the_gpus_and_gpus_counts_within_them(tmp_path, fake_machine):
    env = {**fake_machine, "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    result = harness("--synthetic", "--dry-run", "--out", tmp_path / "out", env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "  ddp_launch-n4-b64-r1: CUDA_VISIBLE_DEVICES=4,5,6,7 torchrun --standalone --nproc_per_node 4 " \
           "03_ddp_launch.py --batch-size 64" in "\n".join(lines)
    assert any(line.startswith("  single-n1-b64-r1: CUDA_VISIBLE_DEVICES=4 python 01_single_gpu.py") for line in lines)
    assert not list(tmp_path.iterdir())  # a dry run runs and writes nothing (its check of --out leaves nothing)
    result = harness("--synthetic", "--dry-run", "--gpus", "1,2", "--per-gpu-batch", "64,512", "--out", tmp_path,
                     env=env, timeout=60)
    assert "  ddp_spawn-n2-b512-r1: CUDA_VISIBLE_DEVICES=5,6 python 04_ddp_spawn.py --nprocs 2" in result.stdout
    assert "roughly" in result.stdout.splitlines()[0] and "runs planned" in result.stdout.splitlines()[0]
    assert not list(tmp_path.iterdir())


# ---- bad arguments: one line on stderr, exit 2, nothing run

@pytest.mark.parametrize("args, message", [
    (["--modes", "single,pipeline"], "unknown mode pipeline"),
    (["--gpus", "9"], "GPU 9 does not exist: 8 GPU(s) visible"),
    (["--repeats", "0"], "argument --repeats: must be at least 1"),
    (["--cpu", "0"], "argument --cpu: must be at least 1"),
    (["--gpus", "0", "--cpu", "2"], "not allowed with argument"),
    (["--per-gpu-batch", "x"], "argument --per-gpu-batch: expected a whole number, got 'x'"),
    (["--per-gpu-batch", "0"], "argument --per-gpu-batch: must be at least 1, got 0"),  # was a ZeroDivisionError
    (["--epochs", "0"], "argument --epochs: must be at least 1"),
    (["--epoch-images", "-1"], "argument --epoch-images: must be at least 0"),
    (["--timeout", "nan"], "argument --timeout: must be at least 1.0, got nan"),
    (["--variant", "nameless"], "--variant"),
    (["--variant", "base=--lr 2"], "(not base)"),
    (["--resume", "--force"], "not allowed with argument"),
    (["--out", "{file}"], "cannot create output folder"),  # --out is a file
    (["--out", "{file}/out"], "cannot create output folder"),  # --out's parent is a file
])
def test_bad_arguments_give_one_line_and_exit_2(tmp_path, fake_machine, args, message):
    """... and nothing is written: the file in the way keeps its bytes, and nothing is left beside it."""
    blocker = tmp_path / "a-file"
    blocker.write_text("kept")
    args = [arg.format(file=blocker) for arg in args]
    result = harness("--synthetic", "--out", tmp_path / "out", *args, env=fake_machine, timeout=60)  # the last --out
    assert result.returncode == 2, result
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and message in result.stderr, \
        result.stderr
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"] and blocker.read_text() == "kept"


def test_unwritable_output_and_missing_data_are_refused_before_any_run(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = harness("--cpu", "1", "--synthetic", "--out", blocker / "out", timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "cannot create output folder" in result.stderr
    result = harness("--cpu", "1", "--data-dir", tmp_path / "empty", "--no-download", "--out", tmp_path / "o",
                     timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "MNIST is not in" in result.stderr
    assert not (tmp_path / "o").exists()


# ---- a real sweep: a failed run does not stop it, --resume redoes it

FAIL_01 = """import atexit, os, sys
if os.path.basename(sys.argv[0]) == "01_single_gpu.py" and os.environ.get("BENCH_TEST_FAIL_01"):
    sys.exit("01 failed on purpose")
aborted = os.environ.get("BENCH_TEST_ABORT_06")  # torch's abort at a worker's exit, once: 06's rank 1
if os.path.basename(sys.argv[0]) == "06_fault_tolerant.py" and os.environ.get("RANK") == "1" and aborted \
        and not os.path.exists(aborted):
    open(aborted, "w").close()
    atexit.register(lambda: (print("terminate called without an active exception", file=sys.stderr, flush=True),
                             os.abort()))
"""


SWEPT = ["single", "ddp_multinode", "ddp_fault_tolerant"]  # 01, the two "nodes" of 05, and 06's snapshots
SWEEP = ["--cpu", "2", "--modes", ",".join(SWEPT), *TINY]


@pytest.fixture(scope="module")
def full_sweep(tmp_path_factory, quick_mnist_dir, fake_machine):
    """A CPU sweep of three modes, twice: first with 01 failing (a sitecustomize.py that every Python process
    of the sweep loads), then --resume without that failure."""
    out, hooks = tmp_path_factory.mktemp("sweep") / "results", tmp_path_factory.mktemp("hooks")
    (hooks / "sitecustomize.py").write_text(FAIL_01)
    args = [*SWEEP, "--data-dir", quick_mnist_dir, "--out", out]
    env = {**fake_machine, "PYTHONPATH": str(hooks)}
    aborted = hooks / "06-aborted"
    first = harness(*args, env={**env, "BENCH_TEST_FAIL_01": "1", "BENCH_TEST_ABORT_06": str(aborted)}, timeout=900)
    assert aborted.exists(), "06's planted exit abort did not happen"
    first_runs = read_runs(out)
    second = harness(*args, "--resume", env=env)
    return first, first_runs, second, out


def test_a_run_that_torch_aborts_at_a_workers_exit_runs_again_and_says_so(full_sweep):
    first, runs, _, _ = full_sweep
    again = [line for line in first.stdout.splitlines() if "torch aborted a process at its exit" in line]
    assert [line.split(":")[0] for line in again] == [f"ddp_fault_tolerant-n2-b{B}-r1"], first.stdout
    row = runs.set_index("run_id").loc[f"ddp_fault_tolerant-n2-b{B}-r1"]
    assert row["status"] == "ok" and row["steps"] > 0, row  # the second attempt's record, whole


def test_a_failed_run_is_recorded_and_the_sweep_goes_on(full_sweep):
    first, runs, _, out = full_sweep
    assert first.returncode == 1, first.stdout + first.stderr
    runs = runs.set_index("run_id")
    assert runs.loc[f"single-n1-b{B}-r1", "status"] == "failed" and runs.loc[f"single-n1-b{B}-r1", "exit_code"] == 1
    assert "01 failed on purpose" in runs.loc[f"single-n1-b{B}-r1", "log_tail"]
    assert f"FAILED: single-n1-b{B}-r1" in first.stderr
    others = runs.drop(f"single-n1-b{B}-r1")  # every later run, each started with the harness's own Python
    assert (others["status"] == "ok").all(), others[["status", "error", "log_tail"]]


def test_resume_redoes_only_the_failed_run_and_the_sweep_covers_its_modes(full_sweep):
    _, first_runs, second, out = full_sweep
    assert second.returncode == 0, second.stdout + second.stderr
    runs = read_runs(out)
    n_runs = len(runs)
    assert f"{n_runs} runs planned, {n_runs - 1} already done (--resume), 1 to do" in second.stdout
    assert (runs["status"] == "ok").all(), runs[["run_id", "status", "error"]]
    later = runs[runs["mode"] != "single"]
    assert list(later["started_at"]) == list(first_runs[first_runs["mode"] != "single"]["started_at"])
    expected = [("single", 1), ("ddp_fault_tolerant", 2), ("ddp_multinode", 2)]  # 06 at n = 1: only with --cpu 1
    assert sorted(zip(runs["mode"], runs["n"])) == sorted(expected)
    assert [line.split(":")[0] for line in second.stdout.splitlines() if line.startswith("[")] == \
        [f"[1/1] single n=1 (processes) single-n1-b{B}-r1"] * 2  # progress: a start and an end line per run


def test_recorded_batches_follow_the_rules(full_sweep):
    out = full_sweep[3]
    for _, row in read_runs(out).iterrows():
        record = json.loads((out / row["metrics_path"]).read_text())
        argv = record["argv"]
        assert record["global_batch"] == record["per_device_batch"] * record["world_size"], row["run_id"]
        assert row["global_batch"] == record["global_batch"] and record["world_size"] == row["n"]
        loader_batch = row["n"] * B if row["mode"] == "dp" else B  # 02 splits n x B over its GPUs
        assert int(argv[argv.index("--batch-size") + 1]) == row["loader_batch"] == loader_batch
        assert record["global_batch"] == row["n"] * B and record["mode"] == row["mode"]
        assert record["per_device_batch"] == row["per_device_batch"] == B  # the plan's, in runs.csv
        if row["mode"] == "ddp_multinode":
            assert record["nodes"] == 2


def test_summary_compares_with_01_at_n_1(full_sweep):
    """A CPU sweep: its n processes share the cores of 01, so E(n) is X(n) / X(01) at every n."""
    summary = pd.read_csv(full_sweep[3] / "summary.csv").set_index(["mode", "n"])
    base = summary.loc[("single", 1), "samples_per_s"]
    assert summary.loc[("single", 1), "efficiency"] == pytest.approx(1)
    for (mode, n), row in summary.iterrows():
        assert row["speedup"] == pytest.approx(row["samples_per_s"] / base)
        assert row["efficiency"] == pytest.approx(row["samples_per_s"] / base) and row["device_type"] == "cpu"


def test_sweep_writes_plots_report_environment_and_one_log_per_run(full_sweep):
    out = full_sweep[3]
    for png in ("throughput.png", "efficiency.png", "time_to_target.png", "accuracy.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    text = (out / "report.md").read_text()
    for part in [f"## Summary: per-GPU batch {B}", "throughput.png", "## Environment", "## Commands",
                 "torchrun --standalone", "--nr 0", "--nr 1", "python bench/run_all.py --cpu 2"] + SWEPT:
        assert part in text, part
    assert not list(out.rglob("*.pt"))  # 06's snapshots: measured, then deleted, so results stay small
    env = json.loads((out / "env.json").read_text())
    for key in ("host", "cpu_model", "cpu_cores", "torch_version", "cuda_runtime_version", "nccl_version",
                "matmul_allow_tf32", "cudnn_allow_tf32", "cudnn_benchmark", "cudnn_deterministic", "cudnn_version",
                "harness_command", "python"):
        assert key in env, key
    assert env["python"] == sys.executable
    # the all-reduce of the gradient at n = 2, measured before the runs, and every DDP run against its limit
    allreduce = env["allreduce"]["2"]
    assert allreduce["backend"] == "gloo" and allreduce["world_size"] == 2, allreduce
    assert allreduce["gradient_row"]["bytes"] == 4_799_528 and allreduce["gradient_row"]["time_us"] > 0
    limits = text.split("## Limit model", 1)[1].split("\n## ", 1)[0]
    assert "% of the limit" in limits and "t1 = n x B / X(01)" in limits
    for mode in ("ddp_multinode", "ddp_fault_tolerant"):
        assert f"| {mode} | 2 |" in limits, mode
    assert all((out / path).stat().st_size > 0 for path in read_runs(out)["log_path"])
    assert not [p for p in out.rglob("*") if ".tmp" in p.name], "a temporary file was left behind"


def test_a_finished_sweep_is_never_overwritten_and_resumes_only_with_its_settings(full_sweep, quick_mnist_dir):
    out = full_sweep[3]
    before = (out / "runs.csv").read_text()
    args = ["--data-dir", quick_mnist_dir, "--out", out, *SWEEP]
    again = harness(*args, timeout=120)
    assert again.returncode == 2 and "--resume" in again.stderr
    other = harness(*args, "--test-batch-size", "500", "--resume", timeout=120)  # the last one counts
    assert other.returncode == 2 and "other settings (test_batch_size)" in other.stderr
    assert (out / "runs.csv").read_text() == before


def test_a_run_past_its_timeout_is_killed_with_all_its_processes(tmp_path):
    marker = uuid.uuid4().hex  # inherited by every process the run starts, torchrun's workers too
    result = harness("--cpu", "1", "--modes", "ddp_launch", "--synthetic", *TINY, "--timeout", "3",
                     "--out", tmp_path / "r", env={"BENCH_TEST_MARKER": marker}, timeout=180)
    assert result.returncode == 1, result.stdout + result.stderr
    row = read_runs(tmp_path / "r").iloc[0]
    assert row["status"] == "timeout" and "3 s timeout" in row["error"]
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and has_marker(pid, marker)]


