"""11_fsdp_tp_mesh.py, run as a user runs it on a 2 x 2 mesh (4 processes): what is 11's alone. Each rank holds a
quarter of fc1 and fc2 and half of the convolutions, --cpu beside a stand-in CUDA GPU trains on the CPU, and a
world size the mesh cannot take is refused in one line. Its update at the global batch, its evaluation (summed
over the dp groups, not again over their TP ranks) and its saved model are the guarantee table's, as every
mode's: tests/guarantees.py, run by test_trainers.py."""
import json
import re

import pytest
import torch

from helpers import (FSDP_TEST_BATCH as TEST_BATCH, RECORD_KEYS, load_script, run, script_command, train_args,
                     with_stand_in_accelerator)

SCRIPT = "11_fsdp_tp_mesh.py"
TP, DP = 2, 2  # the script's TP, and the dp groups of 4 processes
B = 32  # the batch of one dp group, shared by its TP ranks: 01 trains with DP x B
SLICED = {"fc1.weight", "fc1.bias", "fc2.weight"}  # split by the TP ranks (fc2's bias is whole on both)


@pytest.fixture(scope="module")
def runs(quick_mnist_dir, tmp_path_factory):
    """{name: (record, saved weights, stdout)}: 11 on 4 processes with --cpu beside a stand-in CUDA GPU (and the
    stand-in's log). Two short epochs, dropout off, a line per step. Its update and its evaluation are the guarantee
    table's (tests/guarantees.py), as every mode's."""
    found = {}
    stand_in, log = with_stand_in_accelerator(tmp_path_factory.mktemp("stand-in"), "cuda")
    for name, script, nprocs, batch, env in [("11", SCRIPT, 4, B, stand_in)]:
        out = tmp_path_factory.mktemp(name.replace(" ", "-"))
        args = train_args(quick_mnist_dir, out, "--epochs", 2, "--max-steps", 3, "--no-dropout", "--batch-size",
                          batch, "--test-batch-size", TEST_BATCH, *(["--cpu"] if name == "11" else []))
        result = run(script_command(script, *args, nprocs=nprocs), timeout=300, env=env)
        found[name] = json.loads((out / "metrics.json").read_text()), torch.load(out / "model.pt"), result.stdout
    found["stand-in log"] = log.read_text().splitlines()
    return found


def test_each_rank_holds_a_quarter_of_fc1_and_fc2_and_half_of_the_convolutions(runs):
    """Weights, gradients and Adadelta's two running averages (4 float32 tensors a parameter): fc1 and fc2 split by
    TP and again by dp, the convolutions and fc2's bias by dp alone."""
    whole = {name: p.numel() for name, p in load_script("01_single_gpu.py").Net().named_parameters()}
    per_rank = sum((count // TP if name in SLICED else count) // DP for name, count in whole.items())
    assert per_rank == 304677  # of 01's 1,199,882: fc1 294,944, conv2 9,248, fc2 325, conv1 160
    held = runs["11"][0]["epochs_detail"][-1]  # held_bytes() after the last epoch
    assert held["full_copy_bytes"] == 4 * 4 * sum(whole.values())
    assert held["bytes_per_rank"] == [4 * 4 * per_rank] * DP * TP, held["bytes_per_rank"]


def test_with_cpu_beside_a_gpu_it_trains_on_the_cpu_and_only_rank_0_prints_and_records(runs):
    record, _, stdout = runs["11"]
    log = runs["stand-in log"]
    assert [line for line in log if " used " in line] == [], log  # no device call: the mesh on the CPU too
    assert len([line for line in log if line.endswith(SCRIPT)]) == DP * TP, log  # the stand-in in every rank
    assert record["device_type"] == "cpu" and RECORD_KEYS <= record.keys(), RECORD_KEYS - record.keys()
    assert record["steady_samples"] == record["train_samples"] - 2 * record["global_batch"]  # 2 warm-up steps left out
    assert stdout.count("epoch 2:") == 1 and stdout.count("epoch 2 step 0 ") == 1, stdout


def test_a_world_size_that_is_not_a_multiple_of_tp_is_refused_in_one_line():
    """Each of the 3 ranks says it (their lines may run together on torchrun's stderr), before any data is read."""
    result = run(script_command(SCRIPT, "--synthetic", "--max-steps", 1, nprocs=3), timeout=180, check=False)
    errors = re.findall(r"error: .*?processes", result.stderr)
    assert result.returncode != 0 and len(errors) == 3, result.stderr
    assert set(errors) == {"error: 3 ranks make no dp x 2 mesh whose TP ranks split fc1's 128 outputs: start a "
                           "multiple of 2 processes"}, errors
    assert f'{SCRIPT}", line' not in result.stderr, result.stderr  # no traceback of ours: torchrun's report only
