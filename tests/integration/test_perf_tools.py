"""The measurement tools in bench/measure/ (loader_speed, allreduce), run as a user runs them."""
import json
import subprocess
import sys

import pandas as pd
import pytest

from helpers import ROOT, load_script
from bench import measurements, plan, report


def tool(name, *args, timeout=240):
    out = subprocess.run([sys.executable, "-m", f"bench.measure.{name}", *map(str, args)], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{name} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out


def test_loader_speed_reports_the_loader_alone_over_whole_epochs(tmp_path):
    out = tool("loader_speed", "--synthetic", "--cpu", "--passes", 2, "--json", tmp_path / "loader.json")
    result = json.loads((tmp_path / "loader.json").read_text())
    assert result["loader_samples_per_s"] > 0 and len(result["loader_passes_samples_per_s"]) == 2
    assert result["train_samples"] == 60000 // 64 * 64 and result["batch_size"] == 64 and result["device"] == "cpu"
    assert "loader alone:" in out.stdout


def test_harness_measures_the_loader_alone_and_report_divides_it_by_01s_throughput(tmp_path):
    # A large batch: few batches per epoch keep this test quick; the measurement means the same.
    settings = plan.Settings(gpus=[], max_n=1, per_device_batches=[1000], epochs=1,
                             epoch_images=8 * 1000, test_batch_size=1000,
                             seed=1, synthetic=True, data_dir="data", target_acc=0.98, timeout=60, cores=2)
    (tmp_path / "logs").mkdir()
    loader = measurements.measure_loader(settings, str(tmp_path))
    assert loader["loader_samples_per_s"] > 0 and loader["batch_size"] == 1000, loader
    train = loader["loader_samples_per_s"] / 100
    summary = pd.DataFrame([dict(variant="base", per_device_batch=1000, mode="single", n=1, samples_per_s=train)])
    assert "= 100 x 01's " in report.loader_line(dict(loader=loader), summary)
    assert "not measured (boom)" in report.loader_line(dict(loader={"error": "boom"}), summary)


def test_allreduce_reports_busbw_from_algbw_and_includes_the_gradient_size(tmp_path):
    out = tool("allreduce", "--nprocs", 2, "--cpu", "--min-bytes", 4096, "--max-bytes", 16384, "--iters", 2,
               "--warmup", 1, "--json", tmp_path / "allreduce.json")
    result = json.loads((tmp_path / "allreduce.json").read_text())
    params = sum(p.numel() for p in load_script().Net().parameters())
    assert result["gradient_bytes"] == params * 4 == 4_799_528
    assert [r["bytes"] for r in result["rows"]] == [4096, 16384, 4_799_528]
    n = result["world_size"]
    assert n == 2 and result["backend"] == "gloo"
    for r in result["rows"]:
        assert r["busbw_gb_s"] == pytest.approx(r["algbw_gb_s"] * 2 * (n - 1) / n)
        assert r["algbw_gb_s"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
    assert "4,799,528" in out.stdout and "model's gradient" in out.stdout
    assert "torch_version" in json.loads((tmp_path / "env.json").read_text())


@pytest.mark.parametrize("tool", ["allreduce", "loader_speed"])
def test_the_tools_try_their_json_path_as_the_scripts_do(tool, tmp_path):
    """With 01's own check, before measuring: in a missing folder, under a file, in a folder no one may write in
    (root too), or a folder itself."""
    (tmp_path / "a-file").write_text("kept")
    for path in [tmp_path / "no" / "a.json", tmp_path / "a-file" / "m.json", "/proc/m.json", tmp_path]:
        out = subprocess.run([sys.executable, "-m", f"bench.measure.{tool}", "--json", path], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "cannot write" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"] and (tmp_path / "a-file").read_text() == "kept"


def test_the_flight_recorder_names_the_rank_that_skipped_a_collective(tmp_path):
    """Two gloo ranks: rank 1 skips an all-reduce. Each rank's flight record is dumped at the timeout, and torch's
    analyser, reading them, names rank 1 and the all-reduce (on NCCL: tests/integration/test_gpu.py)."""
    out = tool("flight_recorder", "--cpu", "--out", tmp_path, timeout=120)
    analysis = (tmp_path / "analysis.txt").read_text()
    assert "missing ranks: {1}" in analysis and "collective: gloo:all_reduce" in analysis, analysis
    assert sorted(p.name for p in tmp_path.glob("rank_*")) == ["rank_0", "rank_1"]
    assert "the analyser names rank 1" in out.stdout


def test_gloos_flight_record_is_made_readable_for_the_analyser(tmp_path):
    """torch 2.14.1's gloo names the default group '' in pg_config and '0' in its entries; without agree(), the
    analyser stops with a KeyError."""
    import pickle
    from bench.measure import flight_recorder
    entry = dict(process_group=("0", "default_pg"))
    for rank in range(2):
        (tmp_path / f"rank_{rank}").write_bytes(pickle.dumps(dict(pg_config={"": dict(name="", desc="")},
                                                                  entries=[entry])))
    flight_recorder.agree(str(tmp_path))
    dump = pickle.loads((tmp_path / "rank_1").read_bytes())
    assert dump["pg_config"]["0"] == dict(name="0", desc="default_pg", ranks="[0, 1]")
