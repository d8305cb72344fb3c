"""bench/measure/step_forms.py on the CPU, in this process: the eager form timed, the graph form skipped saying why,
the timed window, and the learning rate the captured step reads. On CUDA: tests/integration/test_gpu.py; as the
GPU check starts it: tests/integration/test_gpu_check_steps.py."""
import json
from types import SimpleNamespace

import pytest
import torch

from bench.measure import step_forms
from helpers import load_script

CPU = torch.device("cpu")


def test_on_the_cpu_the_eager_form_is_timed_and_the_graph_form_says_why_it_is_skipped(tmp_path, capsys):
    out = tmp_path / "forms.json"
    assert step_forms.main(["--cpu", "--forms", "eager,graph", "--warmup", "3", "--steps", "2",
                            "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    eager, graph = result["forms"]["eager"], result["forms"]["graph"]
    assert eager["samples_per_s"] > 0 and eager["step_ms"] > 0 and eager["warmup_s"] > 0
    assert graph == {"skipped": "needs CUDA (a CUDA graph replays recorded GPU work; this run is on cpu)"}
    assert result["capture_check"] == graph and (result["batch_size"], result["device"]) == (64, "cpu")
    printed = capsys.readouterr().out.splitlines()
    assert printed[3] == f"graph    skipped: {graph['skipped']}" and printed[4].startswith("capture check: skipped")


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")  # no optimizer step here
def test_the_learning_rate_of_the_captured_step_is_a_tensor_that_a_scheduler_changes_in_place():
    """A graph reads a tensor's memory at each replay, but holds a float as a constant from its capture: with a
    float, StepLR would change the optimizer's number and not what the graph does."""
    optimizer = step_forms.capturable_adadelta(load_script().Net(), step_forms.LR)
    lr = optimizer.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and optimizer.defaults["capturable"]
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=step_forms.GAMMA).step()
    assert optimizer.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(step_forms.LR * step_forms.GAMMA)


def eager_capture(frozen_lr):
    """A stand-in for captured_step on the CPU, where there is no CUDA graph: the same steps, eager. With frozen_lr,
    the steps keep the learning rate they started with, as a graph with a float baked in would."""
    def captured_step(model, first_batches):
        scheduled = torch.optim.Adadelta(model.parameters(), lr=torch.tensor(step_forms.LR))
        stepping = torch.optim.Adadelta(model.parameters(), lr=step_forms.LR) if frozen_lr else scheduled
        for inputs, labels in first_batches:
            step_forms.train_step(model, stepping, inputs, labels)
        return (lambda inputs, labels: step_forms.train_step(model, stepping, inputs, labels)), scheduled
    return captured_step


@pytest.mark.parametrize("frozen_lr", [False, True])
def test_the_check_compares_the_updates_before_and_after_a_scheduler_step(frozen_lr, monkeypatch):
    """The check's own logic, on the CPU (the real graph: tests/integration/test_gpu.py): same weights, same
    batches in the same order, and a learning rate that the scheduler must reach."""
    monkeypatch.setattr(step_forms, "captured_step", eager_capture(frozen_lr))
    check = step_forms.check_capture(load_script(), step_forms.synthetic_batches(CPU))
    assert check["before"]["lr"] == 1.0 and check["after"]["lr"] == pytest.approx(0.7)
    assert check["before"]["within_tolerance"] and check["matches"] != frozen_lr, check
    if frozen_lr:  # two steps at lr 1 instead of 0.7: far outside float tolerance
        assert check["after"]["largest_difference"] > 100 * step_forms.ATOL


@pytest.mark.parametrize("form", ["eager", "compile"])
def test_warm_up_and_compilation_are_outside_the_timed_window_and_every_form_takes_the_same_batches(form,
                                                                                                   monkeypatch):
    """With a clock that reads the steps taken, and compile a stand-in (compiling takes a minute here)."""
    taken = []
    monkeypatch.setattr(step_forms, "train_step", lambda model, optimizer, inputs, labels: taken.append(inputs))
    monkeypatch.setattr(step_forms.torch, "compile", lambda model: model)
    m01 = SimpleNamespace(Net=load_script().Net, clock=lambda device: len(taken))
    batches = step_forms.synthetic_batches(CPU)
    row = step_forms.measure(form, m01, CPU, batches, warmup=4, steps=20)
    assert row["warmup_s"] == 4 and row["step_ms"] == 1e3  # the clock read 4 steps, then 24: 20 timed steps
    assert row["samples_per_s"] == step_forms.BATCH  # 20 batches of 64 in "20 seconds"
    position = {id(inputs): i for i, (inputs, _) in enumerate(batches)}
    assert [position[id(inputs)] for inputs in taken] == [i % step_forms.BATCHES for i in range(24)]


def test_the_batches_are_the_same_in_every_run():
    first, again = step_forms.synthetic_batches(CPU), step_forms.synthetic_batches(CPU)
    assert len(first) == step_forms.BATCHES and first[0][0].shape == (64, 1, 28, 28)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))


def test_an_unknown_form_is_refused_before_any_work(capsys):
    with pytest.raises(SystemExit) as refused:
        step_forms.main(["--cpu", "--forms", "eager,jit"])
    assert refused.value.code == 2 and "--forms: jit is none of eager, compile, graph" in capsys.readouterr().err
