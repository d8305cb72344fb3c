"""What a GPU does differently, on the CPU. On a CUDA GPU PyTorch takes other paths by default than on the CPU: the
optimizers update all weights as one list (foreach), cuDNN's convolution backward rounds differently from call to
call, and the CPU does not wait for the GPU unless it reads a result or copies a batch without non_blocking. A test
that runs on the CPU's defaults sees none of it: 09 crashed at its first step on every CUDA GPU, and every test
passed. Here every numbered script runs as a user starts it, with the hook in tests/as_on_cuda on PYTHONPATH: the
CPU takes CUDA's paths, in every process of the run."""
import json
from pathlib import Path

import pytest
import torch

from helpers import (MODES, QUICK_TEST_IMAGES, as_on_cuda, free_port, processes_for, run, run_two_nodes,
                     script_command)
from bench import plan

STEPS = 8  # one epoch of 8 steps: a host read made at every step would be counted 8 times
PROCESSES = 2  # or the fewest a mode's row runs with (helpers.processes_for: 4 for 11's 2 x 2 mesh)
RANK_WEIGHTS = Path(__file__).resolve().parent / "rank_weights"  # each rank's tensors, saved as it exits
LOOP = {"train_epoch", "training_step", "timed"}  # the functions a training step passes through, in every script


def trained(name, data_dir, tmp_path, hooks=(), env=None):
    """A short run of mode `name` as a user starts it, under the hook (and hooks after it, with env); its record
    and the hook's line of each training process."""
    mode = MODES[name]
    if plan.unavailable_reason(name):
        pytest.skip(f"{mode.script}: {plan.unavailable_reason(name)}")
    hooked, log = as_on_cuda(tmp_path, *hooks)
    env = {**hooked, **(env or {})}
    args = ["--data-dir", data_dir, "--max-steps", STEPS, "--batch-size", 16, "--log-interval", 0,
            "--metrics-json", tmp_path / "metrics.json"]
    args += ["--snapshot", tmp_path / "snapshot.pt"] if mode.snapshot else []
    if mode.launch.nodes > 1:
        run_two_nodes(*args, timeout=240, env=env)
    else:
        args += ["--master-port", free_port()] if "--master-port" in mode.flags else []
        nprocs = processes_for(mode, PROCESSES) if mode.collective else None
        run(script_command(mode.script, *args, nprocs=nprocs), timeout=240, env=env,
            on_again=lambda: log.unlink(missing_ok=True))  # each process appends its line: the last run's only
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["epochs_detail"][0]["test_samples"] == QUICK_TEST_IMAGES
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    # Not torchrun's agent, nor spawn's parent: the processes that trained (10's stage 1 runs no convolution).
    training = [line for line in lines if line["conv_grads"] or "train_epoch" in line["copies"]]
    assert len(training) == record["world_size"], lines  # the hook ran in every rank
    return record, training


@pytest.mark.parametrize("name", MODES)
def test_every_script_trains_on_cudas_default_paths(name, quick_mnist_dir, tmp_path):
    """The foreach update (09 mixed plain tensors and DTensors in it), and a step that never waits: its batch
    copied with non_blocking=True, and no read on the host at each step (a loss.item() there would cost a wait)."""
    _, processes = trained(name, quick_mnist_dir, tmp_path)
    for process in processes:
        reads = sum(count for function, count in process["reads"].items() if function in LOOP)
        assert reads < STEPS, f"{MODES[name].script} reads on the host at every step: {process['reads']}"
        for function in LOOP & process["copies"].keys():
            blocking, _ = process["copies"][function]
            assert blocking == 0, f"{MODES[name].script}: {function} copies a batch without non_blocking=True"
    if MODES[name].script != "07_lightning.py":  # Lightning copies the batch itself, non-blocking on CUDA
        assert all(process["copies"]["train_epoch"][1] == 2 * STEPS for process in processes), processes


def test_cudnn_rounding_does_not_part_the_ranks_copies_of_09s_convolutions(quick_mnist_dir, tmp_path):
    """09's ranks each compute the replicated convolutions' gradients alone, never averaged: with cuDNN's default
    rounding they would drift apart, so 09 asks cuDNN for its deterministic kernels. The stand-in rounds every
    convolution gradient unless the flag is set (it does in the DDP scripts, whose all-reduce keeps copies equal)."""
    ranks_dir = tmp_path / "ranks"
    ranks_dir.mkdir()
    _, processes = trained("tensor_parallel", quick_mnist_dir, tmp_path, hooks=[RANK_WEIGHTS],
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
