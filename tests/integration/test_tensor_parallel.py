"""09_tensor_parallel.py, run as a user runs it: what is 09's alone. Every rank trains on the same batch, so that n
ranks take 01's update at 01's batch, here at 4 ranks (at 2: the guarantee table's, tests/guarantees.py). The ranks
keep identical copies of what is replicated (the convolutions, fc2's bias) with dropout on; each rank holds 1/n of
fc1 and fc2; evaluation with dropout counts every test image once. Each rank's own tensors are read by a hook on
PYTHONPATH (tests/integration/rank_weights), which the script does not know of."""
import json

import pytest
import torch

from helpers import (QUICK_TEST_IMAGES, Lazy, error_lines, evaluate_on_one_process, load_script, on_pythonpath,
                     run, script_command)

SCRIPT = "09_tensor_parallel.py"
BATCH = 64  # every rank's batch, and so the global one: 01 trains with the same
TEST_BATCH = 300  # 1,000 test images: batches of 300, 300, 300 and 100, the same on every rank
SLICED = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}  # the dimension each is split along; the rest whole


@pytest.fixture(scope="module")
def runs(quick_mnist_dir, tmp_path_factory):
    """{(script number, world size, dropout): (record, saved weights, [each rank's tensors])}, each run when first
    asked for: two short epochs at the same batch."""

    def make(key):
        number, n, dropout = key
        out = tmp_path_factory.mktemp(f"{number}-{n}-{'dropout' if dropout else 'no-dropout'}")
        args = ["--data-dir", quick_mnist_dir, "--metrics-json", out / "metrics.json", "--save-model", out / "model.pt",
                "--epochs", 2, "--max-steps", 3, "--batch-size", BATCH, "--test-batch-size", TEST_BATCH,
                "--log-interval", 0, *([] if dropout else ["--no-dropout"])]
        if number == "01":
            run(script_command("01_single_gpu.py", *args), timeout=120)
        else:
            env = dict(PYTHONPATH=on_pythonpath("rank_weights"), RANK_WEIGHTS_DIR=str(out))
            run(script_command(SCRIPT, *args, nprocs=n), timeout=240, env=env)
        ranks = [torch.load(out / f"rank{rank}.pt") for rank in range(n)] if number == "09" else None
        return json.loads((out / "metrics.json").read_text()), torch.load(out / "model.pt"), ranks

    return Lazy(make)


@pytest.mark.parametrize("n", [4])  # at 2 ranks: the guarantee table's (tests/guarantees.py)
def test_tensor_parallel_takes_the_update_of_01_at_the_same_batch(n, runs):
    """Dropout off: the only difference left is the order of the sums that the slices split."""
    record, weights, _ = runs["09", n, False]
    assert (record["world_size"], record["backend"]) == (n, "gloo")
    assert (record["global_batch"], record["steps"]) == (BATCH, 6)
    assert record["train_samples"] == 6 * BATCH  # one batch a step, however many ranks share it
    reference_record, reference_weights, _ = runs["01", 1, False]
    for mine, theirs in zip(record["epochs_detail"], reference_record["epochs_detail"], strict=True):
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-5)
    assert weights.keys() == reference_weights.keys()
    for name, tensor in reference_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert record["epochs_detail"][1]["train_loss"] < record["epochs_detail"][0]["train_loss"]  # it learns


@pytest.mark.parametrize("n", [2, 4])
def test_with_dropout_the_ranks_keep_identical_copies_of_what_is_replicated(n, runs):
    """Every rank draws its dropout masks from the same seed in the same shapes, so that the replicated activations
    are dropped alike everywhere; a per-rank seed, or a layer that drew numbers on one rank only, would make the
    copies part. The saved model is each rank's slices put together around those copies."""
    record, weights, ranks = runs["09", n, True]
    for name, saved in weights.items():
        held = [rank[name] for rank in ranks]
        if name in SLICED:
            assert all(placements == (f"S({SLICED[name]})",) for _, placements in held), (name, held[0][1])
            torch.testing.assert_close(torch.cat([t for t, _ in held], SLICED[name]), saved, rtol=0, atol=0)
        else:
            assert all(placements in (None, ("R",)) for _, placements in held), (name, held[0][1])
            for rank, (tensor, _) in enumerate(held):
                assert torch.equal(tensor, saved), f"{name}: rank {rank}'s copy differs from rank 0's"
    without_dropout = runs["09", n, False][1]
    assert not torch.equal(weights["conv1.weight"], without_dropout["conv1.weight"])  # the masks took effect


@pytest.mark.parametrize("n", [2, 4])
def test_each_rank_holds_one_nth_of_fc1_and_fc2(n, runs):
    """Weights, gradients and Adadelta's two running averages: of fc1 and fc2 each rank keeps its 1/n, of the
    convolutions and fc2's bias a whole copy."""
    net = load_script("01_single_gpu.py").Net()
    whole = {name: p.numel() for name, p in net.named_parameters()}  # 01's: 1,199,882 in all
    per_rank = sum(count // n if name in SLICED else count for name, count in whole.items())
    record, _, ranks = runs["09", n, False]
    record = record["epochs_detail"][-1]  # held_bytes() after the last epoch
    assert record["full_copy_bytes"] == 4 * 4 * sum(whole.values())  # float32, four tensors a parameter
    assert record["bytes_per_rank"] == [4 * 4 * per_rank] * n, record["bytes_per_rank"]
    for rank in ranks:
        for name in SLICED:
            assert rank[name][0].numel() * n == whole[name], name


@pytest.mark.parametrize("dropout", [True])  # without dropout at 2 ranks: the guarantee table's
def test_evaluation_counts_every_test_image_once(dropout, runs, quick_mnist_dir):
    """All ranks score every image together (each computes its slice of each output); it is counted once."""
    for n in [2, 4]:
        record, weights, _ = runs["09", n, dropout]
        assert [e["test_samples"] for e in record["epochs_detail"]] == [QUICK_TEST_IMAGES] * 2
        reference = evaluate_on_one_process(quick_mnist_dir, weights)
        assert record["test_accuracy"] == reference["test_accuracy"]
        assert record["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-5)


def test_a_world_size_that_does_not_divide_fc1_is_refused_in_one_line():
    result = run(script_command(SCRIPT, "--synthetic", "--max-steps", 1, nprocs=3), timeout=180, check=False)
    errors = error_lines(result.stderr)
    assert result.returncode != 0 and errors, result.stderr
    assert set(errors) == {"error: fc1's 128 outputs do not split evenly over 3 ranks: start a number of "
                           "processes that divides it"}, errors
    assert f'{SCRIPT}", line' not in result.stderr, result.stderr  # no traceback of ours: torchrun's report only
