"""08_fsdp.py, run as a user runs it: FSDP2 takes DDP's update, each rank holds 1/n of the weights, gradients and
optimizer state, evaluation counts every test image once, and the saved model is one plain state dict 01 loads
(its code against 03's, in this process: tests/unit/test_fsdp_code.py)."""
import json
import os

import pytest
import torch

from helpers import (FSDP_TEST_BATCH as TEST_BATCH, QUICK_TEST_IMAGES, Lazy, assert_same_update,
                     evaluate_on_one_process, load_script, other_kernels, rounding_spread, run, script_command,
                     train_args)

GLOBAL_BATCH = 96  # = 1 x 96 = 2 x 48 = 3 x 32: every world size takes the same batches of the same order


@pytest.fixture(scope="module")
def runs(quick_mnist_dir, tmp_path_factory):
    """{(script number, world size): (record, saved weights)}, each run when first asked for: two short epochs at the
    same global batch, dropout off so that the updates compare."""

    def make(key):
        number, n, *kernels = key  # ("01", 1, "other"): 01 on other CPU kernels, for the spread of rounding
        script = {"01": "01_single_gpu.py", "03": "03_ddp_launch.py", "08": "08_fsdp.py"}[number]
        out = tmp_path_factory.mktemp(f"{number}-{n}")
        args = train_args(quick_mnist_dir, out, "--epochs", 2, "--max-steps", 3, "--no-dropout", "--batch-size",
                          GLOBAL_BATCH // n, "--test-batch-size", TEST_BATCH, "--log-interval", 0)
        run(script_command(script, *args, nprocs=None if number == "01" else n), timeout=120,
            env=other_kernels() if kernels else None)
        return json.loads((out / "metrics.json").read_text()), torch.load(out / "model.pt")

    return Lazy(make)


@pytest.mark.parametrize("n", [3])  # at 2 ranks: the guarantee table's (tests/guarantees.py)
def test_fsdp_takes_the_update_of_03_and_01(n, runs):
    """03 (two processes) and 01 at the same global batch. The guard against gradients summed instead of
    averaged (gloo's reduce-scatter once summed them: pytorch issue 162338)."""
    record, weights = runs["08", n]
    assert (record["world_size"], record["backend"]) == (n, "gloo")
    assert (record["global_batch"], record["steps"]) == (GLOBAL_BATCH, 6)
    spread = rounding_spread(runs["01", 1][1], runs["01", 1, "other"][1])
    for reference in [("03", 2), ("01", 1)]:
        reference_record, reference_weights = runs[reference]
        for mine, theirs in zip(record["epochs_detail"], reference_record["epochs_detail"], strict=True):
            assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-4), reference
        assert_same_update(weights, reference_weights, spread, msg=str(reference))
    if n == 2:  # two ranks: a sum of two is one sum in any order, and halving is exact: 03's update, bitwise
        assert all(torch.equal(weights[name], t) for name, t in runs["03", 2][1].items()), "not 03's, bitwise"
    assert record["epochs_detail"][1]["train_loss"] < record["epochs_detail"][0]["train_loss"]  # it learns


def test_each_rank_holds_one_nth_of_the_weights_gradients_and_optimizer_state(runs):
    parameters = sum(p.numel() for p in load_script("01_single_gpu.py").Net().parameters())  # 1,199,882
    full = 4 * 4 * parameters  # float32 weights, their gradients and Adadelta's two running averages: DDP's copy
    for n in [1, 2, 3]:
        record = runs["08", n][0]["epochs_detail"][-1]  # held_bytes() after the last epoch
        held = record["bytes_per_rank"]
        # A layer left gathered once it ran (the root not sharded: each layer a root) has whole weights, no shards
        assert record["full_copy_bytes"] == full and len(held) == n, record["full_copy_bytes"]
        assert sum(held) == full, held  # together one copy: nothing held twice, nothing left out
        assert max(held) <= 1.02 * full / n, held  # rows split unevenly: at n = 3 rank 0 has 43 of fc1's 128


@pytest.mark.parametrize("n", [1, 3])  # 1,000 rows over 3 ranks: 334, 333, 333; at 2 ranks: the table's
def test_sharded_evaluation_counts_every_test_image_once(n, runs, quick_mnist_dir):
    record, weights = runs["08", n]
    reference = evaluate_on_one_process(quick_mnist_dir, weights)
    assert [e["test_samples"] for e in record["epochs_detail"]] == [QUICK_TEST_IMAGES] * 2
    assert record["test_accuracy"] == reference["test_accuracy"]
    assert record["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-6)


# Put first on a worker's path: each dropout call of a training forward writes down the generator's state it draws
# its mask from (the same state and shape: the same mask).
DROPOUT_SPY = """
import os
if os.environ.get("RANK") is not None:  # a worker, not torchrun's agent
    import hashlib
    import torch
    import torch.nn.functional as F
    dropout = F.dropout

    def recording(input, p=0.5, training=True, inplace=False):
        if training and p > 0:
            with open(os.path.join(os.environ["DROPOUT_LOG"], "rank" + os.environ["RANK"]), "a") as log:
                log.write(hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest() + "\\n")
        return dropout(input, p, training, inplace)
    F.dropout = recording
"""


def test_each_rank_draws_its_own_dropout_masks(quick_mnist_dir, tmp_path):
    """Every other 08 test runs --no-dropout. Two ranks with dropout on for two steps: each of their dropout
    layers draws from a generator state of its own; the same one on both ranks would drop the same units."""
    (tmp_path / "spy").mkdir()
    (tmp_path / "spy" / "sitecustomize.py").write_text(DROPOUT_SPY)
    path = os.pathsep.join(filter(None, [str(tmp_path / "spy"), os.environ.get("PYTHONPATH")]))
    run(script_command("08_fsdp.py", "--data-dir", quick_mnist_dir, "--max-steps", 2, "--batch-size", 16,
                       "--log-interval", 0, nprocs=2), env={"PYTHONPATH": path, "DROPOUT_LOG": str(tmp_path)},
        timeout=120)
    logs = [tmp_path / f"rank{rank}" for rank in range(2)]
    assert all(log.exists() for log in logs), "the spy on F.dropout saw no dropout call"
    states = [log.read_text().split() for log in logs]
    assert len(states[0]) == len(states[1]) >= 4, states  # two dropout layers, two steps (evaluation: none)
    same = [i for i, (mine, theirs) in enumerate(zip(*states)) if mine == theirs]
    assert not same, f"dropout calls {same} of {len(states[0])} drew the same masks on both ranks"
