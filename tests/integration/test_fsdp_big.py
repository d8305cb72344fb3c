"""12's sharded snapshots: a killed rank resumes bitwise at the same world size, a snapshot of 4 ranks resumes on 2
and one of 2 on 4 (the same global batch: to rounding), and a foreign, torn or mismatched snapshot is refused in
one line with nothing changed."""
import json
import os
import shutil
import signal

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from helpers import ROOT, error_lines, on_pythonpath, run, script_command
from test_reliability import RESTARTED, Job, children

SCRIPT = "12_fsdp_big.py"
# 20 steps an epoch at a global batch of 64: snapshots at steps 8 and 16 and at each epoch's end.
TRAIN = ["--epochs", 2, "--max-steps", 20, "--log-interval", 0, "--snapshot-every", 8, "--threads", 1]
BATCH = {2: 32, 4: 16}  # per rank: 64 in all at both world sizes
BOUND = 1e-4  # the largest weight difference a resharded resume may end with (measured: 3.7e-5 on random data)


def command(out, data, n, *extra, launcher=()):
    out.mkdir(exist_ok=True)
    return script_command(SCRIPT, "--data-dir", data, "--batch-size", BATCH[n], "--snapshot", out / "s.pt",
                          "--save-model", out / "model.pt", "--metrics-json", out / "metrics.json", *TRAIN, *extra,
                          nprocs=n, launcher=launcher)


def outputs(out):
    return json.loads((out / "metrics.json").read_text()), torch.load(out / "model.pt")


@pytest.fixture(scope="module")
def whole(quick_mnist_dir, tmp_path_factory):
    """Uninterrupted runs at n = 2: dropout on (each rank's masks must resume) and off (for the resharded runs)."""
    runs = {}
    for name, extra in [("dropout", []), ("no dropout", ["--no-dropout"])]:
        out = tmp_path_factory.mktemp("whole") / name.replace(" ", "-")
        run(command(out, quick_mnist_dir, 2, *extra))
        runs[name] = outputs(out)
    return runs


def test_a_killed_rank_resumes_bitwise_at_the_same_world_size(whole, quick_mnist_dir, tmp_path):
    out = tmp_path / "killed"
    job = Job(command(out, quick_mnist_dir, 2, "--log-interval", 1, launcher=["--max-restarts", "3"]),
              env={"LOGLEVEL": "INFO"})
    try:  # in epoch 2, one step after its first snapshot: the schedule, the RNGs and the loss sum resume too
        job.wait_for_line("epoch 2 step 9 ", timeout=120)
        os.kill(children(job.process.pid)[-1], signal.SIGKILL)
        returncode, stdout, stderr = job.finish(120, "the restarted job")
    finally:
        job.kill()
    # One restart, for the kill. A second comes only from torch's known abort at a finished worker's exit
    # (helpers.EXIT_ABORT, seen under load): that attempt finds the last snapshot complete and does nothing.
    extra = stderr.count(RESTARTED) - 1
    assert returncode == 0 and extra in (0, 1), stderr[-3000:]
    assert stderr.count("epochs: nothing to do") == 2 * extra, stderr[-3000:]  # each rank of the extra attempt
    assert "resuming from" in stdout and "epoch 2, step 8" in stdout, stdout
    record, weights = outputs(out)
    reference, expected = whole["dropout"]
    assert all(torch.equal(weights[k], expected[k]) for k in expected), "the resumed weights differ"
    keys = ("test_loss", "test_accuracy", "test_samples")
    assert {k: record["epochs_detail"][-1][k] for k in keys} == {k: reference["epochs_detail"][-1][k] for k in keys}
    assert record["epochs_detail"][-1]["train_loss"] == pytest.approx(reference["epochs_detail"][-1]["train_loss"])
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("s.pt")) == ["s.pt", "s.pt.epoch3-step0"], \
        "one snapshot is kept, with no temporary file"
    shards = sorted((out / "s.pt.epoch3-step0").glob("__*"))
    assert [p.name for p in shards] == ["__0_0.distcp", "__1_0.distcp"], "each rank writes its own shard file"
    assert set(record["epochs_detail"][-1]["snapshot_bytes"]) == {p.name for p in shards}


def test_recomputed_activations_give_the_same_weights_bit_for_bit(whole, quick_mnist_dir, tmp_path):
    """--checkpoint-activations changes what backward keeps, not what it computes: with dropout off, the weights
    end as without it, bit for bit."""
    run(command(tmp_path, quick_mnist_dir, 2, "--no-dropout", "--checkpoint-activations"))
    _, weights = outputs(tmp_path)
    _, expected = whole["no dropout"]
    assert all(torch.equal(weights[k], expected[k]) for k in expected), "checkpointing changed the update"


@pytest.mark.parametrize("before, after", [(4, 2), (2, 4)])
def test_a_snapshot_resumes_on_another_number_of_ranks_at_the_same_global_batch(before, after, whole,
                                                                                  quick_mnist_dir, tmp_path):
    out = tmp_path / "resharded"
    first = run(command(out, quick_mnist_dir, before, "--no-dropout", "--epochs", 1))
    assert first.returncode == 0
    dcp_to_torch_save(out / "s.pt.epoch2-step0", tmp_path / "saved.pt")  # every rank's shards, whole
    hook = dict(PYTHONPATH=on_pythonpath("loaded_state"), LOADED_STATE_DIR=str(tmp_path))
    resumed = run(command(out, quick_mnist_dir, after, "--no-dropout"), env=hook)
    assert "resuming from" in resumed.stdout and "epoch 2, step 0" in resumed.stdout, resumed.stdout
    saved, loaded = (torch.load(tmp_path / name) for name in ("saved.pt", "loaded.pt"))
    assert list(flatten(loaded)) == list(flatten(saved)), "the loaded state is not the saved one"
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(flatten(loaded, True), flatten(saved, True))), \
        f"{before} -> {after} ranks: a loaded parameter or optimizer state differs from the saved one"
    record, weights = outputs(out)
    _, expected = whole["no dropout"]
    worst = max((weights[k] - expected[k]).abs().max().item() for k in expected)
    assert 0 < worst or before == after
    assert worst < BOUND, f"{before} -> {after} ranks: the weights end {worst:.2e} from the uninterrupted run's"
    assert record["world_size"] == after and record["global_batch"] == 64


def flatten(state, tensors=False, name=""):
    """Each leaf of a state dict in order: its name and, for a tensor, its shape; or with tensors=True the tensors."""
    if isinstance(state, dict):
        for key in sorted(state, key=str):
            yield from flatten(state[key], tensors, f"{name}/{key}")
    elif isinstance(state, (list, tuple)):
        for i, item in enumerate(state):
            yield from flatten(item, tensors, f"{name}/{i}")
    elif torch.is_tensor(state):
        yield state if tensors else (name, tuple(state.shape))
    elif not tensors:
        yield name, state


def test_a_foreign_torn_or_mismatched_snapshot_is_refused_in_one_line(quick_mnist_dir, tmp_path):
    out = tmp_path / "refused"
    run(command(out, quick_mnist_dir, 2, "--no-dropout", "--epochs", 1))
    snapshot = out / "s.pt"
    files = lambda: {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}  # noqa: E731
    before = files()
    other_batch = run(script_command(SCRIPT, "--data-dir", quick_mnist_dir, "--batch-size", 16, "--snapshot",
                                     snapshot, *TRAIN, nprocs=2), check=False)
    assert other_batch.returncode != 0 and "global batch 64" in other_batch.stderr and \
        "global batch 32" in other_batch.stderr, other_batch.stderr
    assert all(line.endswith("match it or move it") for line in error_lines(other_batch.stderr))
    assert files() == before, "a refused resume changed the snapshot"
    (out / "s.pt.epoch2-step0" / ".metadata").unlink()  # half-written: DCP writes .metadata last
    half = run(command(out, quick_mnist_dir, 2, "--no-dropout"), check=False)
    shutil.rmtree(out / "s.pt.epoch2-step0")  # the shards the snapshot names are gone
    torn = run(command(out, quick_mnist_dir, 2, "--no-dropout"), check=False)
    for refused in half, torn:
        assert refused.returncode != 0 and error_lines(refused.stderr) == [
            f"error: cannot load snapshot {snapshot} (FileNotFoundError); move it away"] * 2, refused.stderr
    snapshot.write_bytes(b"not a snapshot")
    foreign = run(command(out, quick_mnist_dir, 2, "--no-dropout"), check=False)
    assert foreign.returncode != 0 and error_lines(foreign.stderr)[0].startswith(
        f"error: cannot load snapshot {snapshot} ("), foreign.stderr
    assert f'File "{ROOT / SCRIPT}"' not in foreign.stderr + torn.stderr + other_batch.stderr  # no worker's traceback
