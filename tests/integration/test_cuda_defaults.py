"""What a GPU does differently, on the CPU. On a CUDA GPU PyTorch takes other paths by default than on the CPU: the
optimizers update all weights as one list (foreach), cuDNN's convolution backward rounds differently from call to
call, and the CPU does not wait for the GPU unless it reads a result or copies a batch without non_blocking. A test
that runs on the CPU's defaults sees none of it: 09 crashed at its first step on every CUDA GPU, and every test
passed. Here 09 and 03 run as a user starts them, with the hook in tests/as_on_cuda on PYTHONPATH: the CPU takes
CUDA's paths, in every process of the run. Every mode's short run takes them too: its foreach update and a
step that never waits (tests/integration/test_each_mode_runs.py)."""
import json

import torch

from helpers import MODES, QUICK_TEST_IMAGES, as_on_cuda, run, script_command, trained_as_on_cuda

STEPS = 8  # one epoch of 8 steps
PROCESSES = 2


def trained(name, data_dir, tmp_path, hooks=(), env=None):
    """A short run of mode `name` (09 or 03: torchrun, 2 processes) as a user starts it, under the hook (and hooks
    after it, with env); its record and the hook's line of each training process."""
    hooked, log = as_on_cuda(tmp_path, *hooks)
    args = ["--data-dir", data_dir, "--max-steps", STEPS, "--batch-size", 16, "--log-interval", 0,
            "--metrics-json", tmp_path / "metrics.json"]
    run(script_command(MODES[name].script, *args, nprocs=PROCESSES), timeout=240, env={**hooked, **(env or {})},
        on_again=lambda: log.unlink(missing_ok=True))  # each process appends its line: the last run's only
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["epochs_detail"][0]["test_samples"] == QUICK_TEST_IMAGES
    return record, trained_as_on_cuda(log, record["world_size"])


def test_cudnn_rounding_does_not_part_the_ranks_copies_of_09s_convolutions(quick_mnist_dir, tmp_path):
    """09's ranks each compute the replicated convolutions' gradients alone, never averaged: with cuDNN's default
    rounding they would drift apart, so 09 asks cuDNN for its deterministic kernels. The stand-in rounds every
    convolution gradient unless the flag is set (it does in the DDP scripts, whose all-reduce keeps copies equal)."""
    ranks_dir = tmp_path / "ranks"
    ranks_dir.mkdir()
    _, processes = trained("tensor_parallel", quick_mnist_dir, tmp_path, hooks=["rank_weights"],
                           env={"RANK_WEIGHTS_DIR": str(ranks_dir)})
    ranks = [torch.load(ranks_dir / f"rank{rank}.pt") for rank in range(PROCESSES)]
    for name in ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"]:
        for rank in range(1, PROCESSES):
            assert torch.equal(ranks[rank][name][0], ranks[0][name][0]), f"rank {rank}'s {name} parted from rank 0's"
    assert all(p["conv_grads"].get("rounded", 0) == 0 and p["conv_grads"]["exact"] > 0 for p in processes)


def test_the_rounding_stand_in_rounds_where_cudnn_is_left_to_its_default(quick_mnist_dir, tmp_path):
    """The stand-in is not idle: 03 leaves cuDNN to its default, and its convolution gradients are rounded."""
    _, processes = trained("ddp_launch", quick_mnist_dir, tmp_path)
    assert all(p["conv_grads"]["rounded"] > 0 and not p["conv_grads"].get("exact") for p in processes), processes
