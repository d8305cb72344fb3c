"""One short run of each mode of the table (bench.family.MODES), started as a user starts it: the script trains on
the quick MNIST and writes its metrics record. The fast tier's end-to-end check; what each mode guarantees (the
same update, exact evaluation, restarts) is proved in tests/integration."""
import json
import math

import pytest

from bench import plan
from helpers import (EPOCH_KEYS, MODES, QUICK_TEST_IMAGES, RUN_KEYS, free_port, processes_for, run, run_two_nodes,
                     script_command)

STEPS, BATCH = 2, 32  # per process: two steps of 32 images (64 in one step for the modes of two processes)
PROCESSES = 2  # where a mode's processes meet in a process group: the smallest world that has to communicate
               # (or the smallest its row runs with: 4 for 11's 2 x 2 mesh)


@pytest.mark.parametrize("name", MODES)
def test_each_mode_trains_and_writes_its_record(name, quick_mnist_dir, tmp_path):
    mode = MODES[name]
    processes = processes_for(mode, PROCESSES) if mode.collective else None  # None: python SCRIPT
    if plan.unavailable_reason(name):  # 07 without lightning; a mode whose script this checkout lacks
        pytest.skip(f"{mode.script}: {plan.unavailable_reason(name)}")
    metrics = tmp_path / "metrics.json"
    args = ["--data-dir", quick_mnist_dir, "--epochs", 1, "--max-steps", STEPS, "--batch-size", BATCH,
            "--log-interval", 0, "--metrics-json", metrics]
    args += ["--snapshot", tmp_path / "snapshot.pt"] if mode.snapshot else []
    if mode.launch.nodes > 1:  # two "nodes" of one process each on this host
        result = run_two_nodes(*args, timeout=180)
    else:  # a script that starts its processes itself takes a free port (04's default may be taken)
        args += ["--master-port", free_port()] if "--master-port" in mode.flags else []
        result = run(script_command(mode.script, *args, nprocs=processes), timeout=180)
    assert "epoch 1:" in result.stdout, result.stdout
    record = json.loads(metrics.read_text())
    world_size = processes or 1  # 02 on the CPU: one replica, saying so
    assert RUN_KEYS <= record.keys(), f"{mode.script} misses {RUN_KEYS - record.keys()}"
    assert record["world_size"] == world_size, mode.script
    global_batch = mode.batch.global_batch(BATCH, world_size)  # 09's ranks share one batch
    assert (record["steps"], record["global_batch"]) == (STEPS, global_batch)
    assert record["train_samples"] == STEPS * global_batch
    (epoch,) = record["epochs_detail"]
    assert EPOCH_KEYS <= epoch.keys() and epoch["test_samples"] == QUICK_TEST_IMAGES
    assert math.isfinite(epoch["train_loss"]) and record["samples_per_s"] > 0
