"""One short run of each mode of the table (bench.family.MODES), started as a user starts it: the script trains on
the quick MNIST and writes its metrics record. Each run takes CUDA's default paths on the CPU (the hook in
tests/as_on_cuda): the optimizers' foreach update, which crashed 09 at its first step on every CUDA GPU, and a
step that never waits for the GPU. The quickest end-to-end check of every mode; what each mode guarantees (the
same update, exact evaluation, restarts) is proved in other files, cuDNN's rounding in test_cuda_defaults.py."""
import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from bench import plan
from helpers import (EPOCH_KEYS, MODES, RECORD_KEYS, TRAIN_IMAGES, as_on_cuda, free_port, processes_for, run,
                     run_two_nodes, script_command, trained_as_on_cuda, write_fake_mnist)

# Per process: 8 steps of 16 images (32 in one step for the modes of two processes). 8: a host read made at every
# step would be counted 8 times.
STEPS, BATCH = 8, 16
TEST_IMAGES = 200  # scored by every mode: the exact-evaluation tests use 1,000, here only the record counts
LOOP = {"train_epoch", "training_step", "timed"}  # the functions a training step passes through, in every script
PROCESSES = 2  # where a mode's processes meet in a process group: the smallest world that has to communicate
               # (or the smallest its row runs with: 4 for 11's 2 x 2 mesh)
AT_ONCE = 2  # runs at a time: a short run waits mostly on its start-up (imports, torchrun, the group), so two
            # share a small machine's cores well; more would only queue for them


def world_size(mode):
    return processes_for(mode, PROCESSES) if mode.collective else 1  # 02 on the CPU: one replica, saying so


def train(name, out, data_dir):
    """One mode's short run, started as a user starts it, as on CUDA: (its result, or the failure it raised; its
    record; the hook's log)."""
    mode, (env, log) = MODES[name], as_on_cuda(out)
    processes = world_size(mode) if mode.collective else None  # None: python SCRIPT
    metrics = out / "metrics.json"
    args = ["--data-dir", data_dir, "--epochs", 1, "--max-steps", STEPS, "--batch-size", BATCH,
            "--log-interval", 0, "--threads", 1, "--metrics-json", metrics]  # threads: one a process
    args += ["--snapshot", out / "snapshot.pt"] if mode.snapshot else []
    try:
        if mode.launch.nodes > 1:  # two "nodes" of one process each on this host
            return run_two_nodes(*args, timeout=180, env=env), metrics, log
        # a script that starts its processes itself takes a free port (04's default may be taken)
        args += ["--master-port", free_port()] if "--master-port" in mode.flags else []
        return run(script_command(mode.script, *args, nprocs=processes), timeout=180, env=env,
                   on_again=lambda: log.unlink(missing_ok=True)), metrics, log  # each process appends its line
    except BaseException as failure:  # raised again by this mode's own test
        return failure, metrics, log


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every available mode's run, AT_ONCE at a time: {name: (result or failure, record path, the hook's log)}."""
    data_dir = write_fake_mnist(str(tmp_path_factory.mktemp("mnist")), train=TRAIN_IMAGES, test=TEST_IMAGES)
    names = [name for name in MODES if not plan.unavailable_reason(name)]
    names.sort(key=lambda name: -world_size(MODES[name]))  # the longest, 11's four processes, first
    with ThreadPoolExecutor(AT_ONCE) as pool:
        done = pool.map(lambda name: train(name, tmp_path_factory.mktemp(name), data_dir), names)
        return dict(zip(names, done))


def finished(name, runs):
    """The mode's run (result, record path, the hook's log); skipped where the mode cannot run here."""
    if plan.unavailable_reason(name):  # 07 without lightning; a mode whose script this checkout lacks
        pytest.skip(f"{MODES[name].script}: {plan.unavailable_reason(name)}")
    if isinstance(runs[name][0], BaseException):
        raise runs[name][0]
    return runs[name]


@pytest.mark.parametrize("name", MODES)
def test_each_mode_trains_and_writes_its_record(name, runs):
    mode = MODES[name]
    result, metrics, _ = finished(name, runs)
    assert "epoch 1:" in result.stdout, result.stdout
    record = json.loads(metrics.read_text())
    assert RECORD_KEYS <= record.keys(), f"{mode.script} misses {RECORD_KEYS - record.keys()}"
    # The record says what ran, as the family table and the command do: no harness needed to tell them apart.
    assert (record["script"], record["mode"], record["epochs"]) == (mode.script, name, 1)
    assert (record["per_device_batch"], record["synthetic"]) == (BATCH, False)
    assert record["torch_version"] == torch.__version__ and record["argv"][0].endswith(mode.script)
    assert record["world_size"] == world_size(mode), mode.script
    global_batch = mode.batch.global_batch(BATCH, world_size(mode))  # 09's ranks share one batch
    assert (record["steps"], record["global_batch"]) == (STEPS, global_batch)
    assert record["train_samples"] == STEPS * global_batch
    (epoch,) = record["epochs_detail"]
    assert EPOCH_KEYS <= epoch.keys() and epoch["test_samples"] == TEST_IMAGES
    assert math.isfinite(epoch["train_loss"]) and record["samples_per_s"] > 0


@pytest.mark.parametrize("name", MODES)
def test_each_mode_takes_cudas_default_paths_and_never_waits_at_a_step(name, runs):
    """The foreach update (09 mixed plain tensors and DTensors in it), and a step that never waits: its batch
    copied with non_blocking=True, and no read on the host at each step (a loss.item() there would cost a wait)."""
    _, metrics, log = finished(name, runs)
    processes = trained_as_on_cuda(log, json.loads(metrics.read_text())["world_size"])
    for process in processes:
        reads = sum(count for function, count in process["reads"].items() if function in LOOP)
        assert reads < STEPS, f"{MODES[name].script} reads on the host at every step: {process['reads']}"
        for function in LOOP & process["copies"].keys():
            blocking, _ = process["copies"][function]
            assert blocking == 0, f"{MODES[name].script}: {function} copies a batch without non_blocking=True"
    if MODES[name].script != "07_lightning.py":  # Lightning copies the batch itself, non-blocking on CUDA
        # Each rank copies its batch's images and labels; 10's stage 1 takes no images, only the labels.
        per_step = [1, 2] if MODES[name].script == "10_pipeline_parallel.py" else [2] * len(processes)
        copies = sorted(process["copies"]["train_epoch"][1] for process in processes)
        assert copies == [each * STEPS for each in per_step], processes
