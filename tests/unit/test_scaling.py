"""bench/measure/scaling.py, in this process: its prediction of E(n) against what the harness measured on the
same machine, and the parts of its model, each in a case where the answer is known."""
import csv
import json

import pytest

from bench.measure import scaling
from helpers import ROOT

SWEEP = ROOT / "results" / "cpu-2core-amd-epyc-anatomy"  # run_all.py --anatomy on the 2-core CPU: 01-11
PREDICTION = ROOT / "results" / "scaling-prediction" / "e8-gpus.json"


def measured_e2(mode):
    with open(SWEEP / "summary.csv", newline="") as f:
        return next(float(r["efficiency"]) for r in csv.DictReader(f) if r["mode"] == mode and r["n"] == "2")


MODES_AT_2 = ["ddp_launch", "fsdp", "tensor_parallel", "pipeline_parallel"]


@pytest.mark.parametrize("mode", MODES_AT_2)
def test_on_the_cpu_the_prediction_of_e2_is_within_10_percent_of_the_harnesss_measured_e2(mode):
    """03, 08, 09 and 10 at 2 ranks on 2 shared cores (10 by its busiest stage and its bubble). The inputs are 01's
    step from the sweep and each mode's split from the anatomy's 3 profiled steps; E(2) comes from the harness's own epoch, apart from both."""
    predicted = scaling.predict(scaling.read_sweep(SWEEP), mode, 2, cores=2)["e_n"]
    assert predicted == pytest.approx(measured_e2(mode), rel=0.10), (mode, predicted, measured_e2(mode))


def test_on_a_cpu_the_communication_costs_the_cores_it_runs_on():
    """gloo reduces on the cores the ranks compute on: leave its time out, and 03's E(2) is far off."""
    sweep = scaling.read_sweep(SWEEP)
    for a in sweep["anatomy"].values():
        a["overlapped_comm_ms"] = a["exposed_comm_ms"] = 0.0
    assert scaling.predict(sweep, "ddp_launch", 2, cores=2)["e_n"] > 1.2 * measured_e2("ddp_launch")


def test_a_given_bus_bandwidth_prices_the_bytes_as_a_ring_all_reduce():
    """One device a rank: 03's step is 01's plus what of the all-reduce stays exposed, 2 (n - 1) / n S / busbw."""
    sweep = scaling.read_sweep(SWEEP)
    a = sweep["anatomy"]["ddp_launch"]
    exposed = a["exposed_comm_ms"] / (a["exposed_comm_ms"] + a["overlapped_comm_ms"])
    step = scaling.predict(sweep, "ddp_launch", 8, step_ms=2.0, busbw=1.0)["step_ms"]
    assert a["bytes"] == 1_199_882 * 4
    assert step == pytest.approx(2.0 + exposed * a["bytes"] * 2 * 7 / 8 / 1e9 * 1e3)


def test_what_cannot_run_is_not_predicted_and_more_ranks_on_few_cores_compute_slower():
    sweep = scaling.read_sweep(SWEEP)
    assert scaling.predict(sweep, "pipeline_parallel", 4, cores=2) is None  # 10 has two stages
    assert scaling.predict(sweep, "fsdp_tp", 2, cores=2) is None  # 11 was measured at 4
    two, four = (scaling.predict(sweep, "ddp_launch", n, cores=2)["step_ms"] for n in (2, 4))
    assert four > 1.9 * two  # 4 ranks on 2 cores: each has half the cores 2 ranks had


def test_the_prediction_says_it_is_one_and_writes_its_inputs(tmp_path, capsys, monkeypatch):
    # The machine's description starts a Python with torch: 3 s. Its own tests are the harness's.
    monkeypatch.setattr(scaling, "environment", lambda repo, gpus: dict(host="stand-in"))
    out = tmp_path / "e.json"
    assert scaling.main(["--from", str(SWEEP), "--step-ms", "1.72", "--busbw", "100", "--cores", "16",
                         "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("PREDICTED E(n), not measured") and "upper bounds" in printed
    written = json.loads(out.read_text())
    assert written["prediction"] is True and (written["step_ms"], written["busbw_gb_s"]) == (1.72, 100.0)
    assert json.loads((tmp_path / "env.json").read_text()) == dict(host="stand-in")


def test_the_committed_prediction_is_what_the_tool_predicts_from_its_inputs():
    committed = json.loads(PREDICTION.read_text())
    again = scaling.table(scaling.read_sweep(ROOT / committed["source"]), committed["cores"], committed["step_ms"],
                          committed["busbw_gb_s"])
    assert {m: {str(n): e for n, e in row.items()} for m, row in again.items()} == committed["e_n"]


def test_a_folder_without_a_sweep_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as refused:
        scaling.main(["--from", str(tmp_path)])
    assert "has no summary.csv" in str(refused.value.code)


def test_a_report_with_the_anatomy_puts_the_predicted_e_n_beside_the_measured(tmp_path):
    import dataclasses
    import shutil
    from bench import report
    from helpers import gpu_settings
    sweep = shutil.copytree(SWEEP, tmp_path / "sweep")  # the summary is written again: not into results/
    _, summary = report.read_and_summarize(str(sweep))
    settings = dataclasses.replace(gpu_settings([]), cores=2)
    (block,) = report.predicted(str(sweep), summary, settings)
    assert "| mode | n | measured E(n) | predicted E(n) |" in block and "a model, not a measurement" in block
    predicted = scaling.predict(scaling.read_sweep(SWEEP), "ddp_launch", 2, cores=2)["e_n"]
    assert f"| ddp_launch | 2 | {measured_e2('ddp_launch'):.1%} | {predicted:.1%} |" in block


def test_a_sweep_without_01_has_no_prediction_and_its_report_is_still_written(tmp_path):
    """A sweep of 03 alone with --anatomy once ended in a traceback: the prediction needs 01's step."""
    import shutil
    from bench import report
    from helpers import gpu_settings
    shutil.copytree(SWEEP, tmp_path / "sweep")
    shutil.rmtree(tmp_path / "sweep" / "anatomy" / "01")
    assert scaling.read_sweep(tmp_path / "sweep") is None
    _, summary = report.read_and_summarize(str(tmp_path / "sweep"))
    assert report.predicted(str(tmp_path / "sweep"), summary, gpu_settings([])) == []
    with pytest.raises(SystemExit) as refused:
        scaling.main(["--from", str(tmp_path / "sweep")])
    assert "no anatomy of 01 and 03" in str(refused.value.code)
