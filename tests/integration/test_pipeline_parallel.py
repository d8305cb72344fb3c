"""10_pipeline_parallel.py, run as a user runs it: two stages split at flatten, both ranks on the same batch, so that
the pipeline takes 01's update at 01's batch with either schedule (GPipe, 1F1B); each stage holds the weights,
gradients and optimizer state of its own layers, stage 1 nearly all of them (fc1); evaluation sends every test
batch through both stages and counts each image once; the saved model is one plain state dict 01 loads; a world of
any other size than 2 is refused in one line."""
import json
from types import SimpleNamespace

import pytest
import torch

from helpers import QUICK_TEST_IMAGES, Lazy, error_lines, evaluate_on_one_process, load_script, run, script_command

SCRIPT = "10_pipeline_parallel.py"
BATCH = 64  # both ranks' batch, and so the global one: 01 trains with the same; 4 microbatches of 16
TEST_BATCH = 300  # 1,000 test images: batches of 300, 300, 300 and 100, each sent from stage 0 to stage 1
STAGE_0 = {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"}  # stage 1: fc1 and fc2


@pytest.fixture(scope="module")
def runs(quick_mnist_dir, tmp_path_factory):
    """{(script number, schedule, dropout): (record, saved weights)}, each run when first asked for: three steps of one
    epoch at the same batch."""

    def make(key):
        number, schedule, dropout = key
        out = tmp_path_factory.mktemp(f"{number}-{schedule}-{'dropout' if dropout else 'no-dropout'}")
        args = ["--data-dir", quick_mnist_dir, "--metrics-json", out / "metrics.json", "--save-model", out / "model.pt",
                "--max-steps", 3, "--batch-size", BATCH, "--test-batch-size", TEST_BATCH, "--log-interval", 0,
                *([] if dropout else ["--no-dropout"])]
        if number == "01":
            run(script_command("01_single_gpu.py", *args), timeout=120)
        else:
            run(script_command(SCRIPT, *args, "--schedule", schedule, nprocs=2), timeout=240)
        return json.loads((out / "metrics.json").read_text()), torch.load(out / "model.pt")

    return Lazy(make)


@pytest.mark.parametrize("schedule", ["1f1b"])  # GPipe, the default: the guarantee table's (tests/guarantees.py)
def test_both_schedules_take_the_update_of_01_at_the_same_batch(schedule, runs):
    """Dropout off: each microbatch's mean loss, the gradients summed over the 4 microbatches and divided by 4, is
    01's batch mean; what is left is the order of the sums."""
    record, weights = runs["10", schedule, False]
    assert (record["world_size"], record["backend"]) == (2, "gloo")
    assert (record["global_batch"], record["steps"], record["train_samples"]) == (BATCH, 3, 3 * BATCH)
    assert record["epochs_detail"][-1]["microbatches"] == 4  # for the report's bubble
    reference_record, reference_weights = runs["01", None, False]
    assert record["epochs_detail"][0]["train_loss"] == pytest.approx(
        reference_record["epochs_detail"][0]["train_loss"], rel=1e-5)
    assert list(weights) == list(reference_weights)  # 01's names, in 01's order
    for name, tensor in reference_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_each_stage_holds_its_own_layers_stage_1_nearly_all(runs):
    """Weights, gradients and Adadelta's two running averages of each stage's layers: the convolutions' 18,816
    parameters on rank 0, fc1's and fc2's 1,181,066 on rank 1 (98% of them), four float32 tensors a parameter."""
    net = load_script("01_single_gpu.py").Net()
    count = {stage: sum(p.numel() for name, p in net.named_parameters() if (name in STAGE_0) == (stage == 0))
             for stage in (0, 1)}
    record = runs["10", "gpipe", True][0]["epochs_detail"][-1]
    assert record["bytes_per_rank"] == [4 * 4 * count[0], 4 * 4 * count[1]], record["bytes_per_rank"]
    assert record["bytes_per_rank"][1] > 0.98 * sum(record["bytes_per_rank"])


@pytest.mark.parametrize("schedule, dropout", [("gpipe", True), ("1f1b", False)])
def test_evaluation_sends_every_test_image_through_both_stages_once(schedule, dropout, runs, quick_mnist_dir):
    """Stage 1 scores what stage 0 sends it, batch by batch, the last one short; with dropout on in training too,
    evaluation is 01's evaluation of the saved weights (both stages in eval mode)."""
    record, weights = runs["10", schedule, dropout]
    assert [e["test_samples"] for e in record["epochs_detail"]] == [QUICK_TEST_IMAGES]
    reference = evaluate_on_one_process(quick_mnist_dir, weights)
    assert record["test_accuracy"] == reference["test_accuracy"]
    assert record["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-5)


def test_a_world_of_other_than_two_processes_is_refused_in_one_line():
    """Three processes started as a user starts them (each says it once; torchrun adds its report), and a world of
    one in this process: run() refuses it before it loads data or builds a stage."""
    result = run(script_command(SCRIPT, "--synthetic", "--max-steps", 1, nprocs=3), timeout=180, check=False)
    errors = error_lines(result.stderr)
    assert result.returncode != 0 and errors, result.stderr
    assert set(errors) == {"error: 2 stages, one a process: --nproc_per_node 2, not 3"}, errors
    assert f'{SCRIPT}", line' not in result.stderr, result.stderr  # no traceback of ours: torchrun's report only
    script = load_script(SCRIPT)
    with pytest.raises(SystemExit) as refused:
        script.run(script.parse_args(["--synthetic"]), SimpleNamespace(world_size=1))  # nothing else it reads
    assert refused.value.code == "error: 2 stages, one a process: --nproc_per_node 2, not 1"
