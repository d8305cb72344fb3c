"""The step anatomy of the scripts, run as a user runs it: bytes per step equal a closed form from the model's
shapes and the batch, and the four parts of the time add up to the step. unit/test_step_anatomy_reading.py
checks the reading of traces on traces written by hand."""
import json
import math
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.family import load_script
from helpers import ROOT

B = 32  # per device; not the default 64, so that a form that ignores the batch fails
FLOAT = 4


def layers(tp=1):
    """[[shape of each parameter] per layer] of the model, with tensor parallelism's slices at tp ranks."""
    net = load_script("01_single_gpu.py").Net()
    shapes = [[list(p.shape) for p in layer.parameters()] for layer in net.children()]
    shapes = [s for s in shapes if s]
    fc1, fc2 = shapes[2], shapes[3]
    fc1[0][0], fc1[1][0] = fc1[0][0] // tp, fc1[1][0] // tp  # fc1 by columns: its outputs, and its bias
    fc2[0][1] //= tp  # fc2 by rows: its inputs; its bias stays whole
    return shapes


def shard(shape, n):  # FSDP2 cuts dim 0 into n pieces of ceil(rows / n), padding the last
    return math.ceil(shape[0] / n) * math.prod(shape[1:])


def fsdp(n, tp=1, gathered=FLOAT):
    """gloo's form of FSDP2's step at n ranks: an all-gather of each layer's shard before its forward and again
    before its backward; gloo has no reduce-scatter, so each layer's gradient is an all-reduce of the whole
    padded buffer. NCCL reduce-scatters instead: each rank hands in the whole, gets 1/n back. gathered: the bytes
    of a gathered weight (12's bf16: 2); the gradients are reduced in fp32 all the same."""
    shards = [sum(shard(p, n) for p in layer) for layer in layers(tp)]
    return {"all_gather": dict(calls=2 * len(shards), in_bytes=2 * sum(shards) * gathered,
                               out_bytes=2 * n * sum(shards) * gathered),
            "all_reduce": dict(calls=len(shards), in_bytes=n * sum(shards) * FLOAT,
                               out_bytes=n * sum(shards) * FLOAT)}


def tensor_parallel():  # fc2's partial outputs in forward, fc1's input gradient in backward: B x 10, B x 9216
    floats = B * 10 + B * 9216
    return {"all_reduce": dict(calls=2, in_bytes=floats * FLOAT, out_bytes=floats * FLOAT)}


def added(a, b):
    return {k: {f: a.get(k, {}).get(f, 0) + b.get(k, {}).get(f, 0) for f in ("calls", "in_bytes", "out_bytes")}
            for k in a.keys() | b.keys()}


def ddp():  # the whole gradient, each step, whatever its buckets: 1,199,882 floats
    floats = sum(math.prod(p) for layer in layers() for p in layer)
    assert floats == 1_199_882
    return {"all_reduce": dict(in_bytes=floats * FLOAT, out_bytes=floats * FLOAT)}


def pipeline(rank, m):  # B x 9216 activations forward and as many gradients back, in m pieces; the loss broadcast
    sent = dict(calls=m, in_bytes=B * 9216 * FLOAT, out_bytes=0)
    received = dict(calls=m, in_bytes=0, out_bytes=B * 9216 * FLOAT)
    return {"send": sent, "recv": received, "broadcast": dict(calls=1, in_bytes=FLOAT, out_bytes=FLOAT)}


def anatomy(tmp_path, script, n, *flags, data_dir=None):
    """bench/anatomy.py as a user runs it; on the tests' small MNIST where given: its 1,000 test images are quicker
    to score than random data's 10,000 (12 in bf16 took 70 s for them)."""
    out = tmp_path / script[:2]
    argv = [sys.executable, "bench/anatomy.py", script, "--nproc", str(n), "--batch-size", str(B), "--out", str(out)]
    argv += ["--data-dir", str(data_dir)] if data_dir else []
    done = subprocess.run(argv + (["--", *flags] if flags else []), cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "timeline.png").stat().st_size > 0
    assert all((out / f"trace-rank{r}.json.gz").exists() for r in range(n))
    assert json.loads((out / "env.json").read_text())["torch_version"] == torch.__version__  # the machine's record
    return json.loads((out / "anatomy.json").read_text())


def assert_adds_up(result):
    for rank in result["per_rank"]:
        assert rank["flops_per_step"] > 0
        for step in rank["steps"]:
            parts = sum(step[k] for k in ("compute_ms", "overlapped_comm_ms", "exposed_comm_ms", "idle_ms"))
            assert abs(parts - step["step_ms"]) <= 0.05 * step["step_ms"], step


CASES = {"03": ("03_ddp_launch.py", 2, lambda r: ddp(), []), "08": ("08_fsdp.py", 2, lambda r: fsdp(2), []),
         "09": ("09_tensor_parallel.py", 2, lambda r: tensor_parallel(), []),
         "10": ("10_pipeline_parallel.py", 2, lambda r: pipeline(r, 8), ["--microbatches", "8"]),
         "11": ("11_fsdp_tp_mesh.py", 4, lambda r: added(tensor_parallel(), fsdp(2, tp=2)), []),
         "12-bf16": ("12_fsdp_big.py", 2, lambda r: fsdp(2, gathered=2), ["--mixed-precision", "bf16"])}


# The least a step's peak can be: 03 makes the whole gradient; while fc1's backward runs, 08 holds fc1's
# gathered weight and its whole gradient.
PEAK_AT_LEAST = {"03": lambda: ddp()["all_reduce"]["in_bytes"],
                 "08": lambda: 2 * FLOAT * sum(math.prod(p) for p in layers()[2])}


@pytest.mark.parametrize("case", CASES)
def test_the_bytes_of_a_step_are_the_closed_form(tmp_path, case, quick_mnist_dir):
    script, n, form, flags = CASES[case]
    result = anatomy(tmp_path, script, n, *flags, data_dir=quick_mnist_dir)
    assert len(result["per_rank"]) == n
    for rank in result["per_rank"]:
        assert len(rank["steps"]) == 3
        for step in rank["steps"]:
            expected = form(rank["rank"])
            measured = {k: {f: v[f] for f in expected[k]} for k, v in step["collectives"].items()} \
                if set(step["collectives"]) == set(expected) else step["collectives"]
            assert measured == expected, f"rank {rank['rank']}"
    assert_adds_up(result)
    if case in PEAK_AT_LEAST:
        assert all(r["step_peak_bytes"] >= PEAK_AT_LEAST[case]() for r in result["per_rank"]), result["per_rank"]
    if case == "10":  # the bubble: stage 1 waits for stage 0's first microbatch (docs/benchmark.md measures it)
        assert sum(s["idle_ms"] for s in result["per_rank"][1]["steps"]) > 0


def test_12s_checkpointed_step_computes_the_forward_again_and_moves_the_same_bytes(tmp_path, quick_mnist_dir):
    """--checkpoint-activations: backward runs the forward again, so a step's FLOPs grow by about one forward. Torch
    stops recomputing once backward has what it needs: fc2's forward is not run again, hence 0.9."""
    result = anatomy(tmp_path, "12_fsdp_big.py", 2, "--checkpoint-activations", data_dir=quick_mnist_dir)
    net, inputs = load_script("12_fsdp_big.py").Net(dropout=False), torch.randn(B, 1, 28, 28)
    with FlopCounterMode(display=False) as forward:
        net(inputs)
    with FlopCounterMode(display=False) as step:
        net(inputs).sum().backward()
    once, twice = step.get_total_flops(), step.get_total_flops() + forward.get_total_flops()
    for rank in result["per_rank"]:
        assert once + 0.9 * (twice - once) < rank["flops_per_step"] <= twice, (rank["flops_per_step"], once, twice)
        assert all({k: {f: v[f] for f in ("calls", "in_bytes", "out_bytes")} for k, v in s["collectives"].items()}
                   == fsdp(2) for s in rank["steps"])


def test_the_harness_adds_each_modes_step_to_its_report(tmp_path, quick_mnist_dir):
    """run_all.py --anatomy: after the sweep, 03's step at n = 2 in anatomy/03, on the sweep's data, the figure and
    the table."""
    argv = [sys.executable, "bench/run_all.py", "--cpu", "2", "--modes", "03", "--data-dir", str(quick_mnist_dir),
            "--epochs", "1", "--epoch-images", "640", "--anatomy", "--out", str(tmp_path)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert all((tmp_path / "anatomy" / "03" / f"trace-rank{r}.json.gz").exists() for r in range(2))
    assert json.loads((tmp_path / "anatomy" / "03" / "anatomy.json").read_text())["synthetic"] is False
    assert (tmp_path / "anatomy.png").stat().st_size > 0
    report = (tmp_path / "report.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| 03 | ddp_launch | 2 |"))
    assert row.endswith(f"| {4 * 1_199_882:,} | {4 * 1_199_882:,} |"), row
    assert "![One step of each mode on a rank](anatomy.png)" in report
