"""bench/anatomy.py's reading of traces, on traces written here: the four parts of a step, a wait on another rank
against a wait on the network, gloo's and NCCL's bytes. tests/integration/test_step_anatomy.py runs the scripts."""
import dataclasses
import gzip
import json
import os
import subprocess
import sys

from bench import anatomy
from helpers import ROOT


def op(name, tid, start, dur, cat="cpu_op", **args):
    return dict(ph="X", name=name, tid=tid, ts=start, dur=dur, cat=cat, args=args)


def write_rank(folder, rank, events, flops=1000):
    marks = [op(anatomy.START_MARK, 1, 0, 1, cat="user_annotation")]
    with gzip.open(folder / f"trace-rank{rank}.json.gz", "wt") as f:
        json.dump(dict(baseTimeNanoseconds=0, traceEvents=marks + events), f)
    (folder / f"flops-rank{rank}.json").write_text(json.dumps(dict(rank=rank, flops_per_step=flops, step_peak_bytes=0)))


def step_of(ranks, rank):
    return ranks[rank]["steps"][0]


def test_a_wait_on_a_computing_rank_is_idle_and_a_wait_of_all_is_exposed(tmp_path):
    # Rank 0 computes 0-40 us, then waits in a recv until 100. Rank 1 computes until 70: 40-70 is idle for rank 0,
    # 70-100 exposed, as both wait. Rank 0's optimizer ends at 110, rank 1's at 120. The CPU between two ops runs
    # Python: 0-1 us is compute.
    write_rank(tmp_path, 0, [op("aten::mm", 1, 1, 39), op("gloo:recv", 1, 40, 60, "user_annotation",
                             **{"Input Dims": [[8, 4]], "Input type": ["float"]}),
                             op("Optimizer.step#SGD.step", 1, 100, 10)])
    write_rank(tmp_path, 1, [op("aten::mm", 1, 1, 69), op("gloo:send", 1, 70, 30, "user_annotation",
                             **{"Input Dims": [[8, 4]], "Input type": ["float"]}),
                             op("Optimizer.step#SGD.step", 1, 100, 20)])
    ranks, _ = anatomy.analyse(tmp_path, 2)
    zero, one = step_of(ranks, 0), step_of(ranks, 1)
    assert zero["idle_ms"] == 0.03 and zero["exposed_comm_ms"] == 0.03 and zero["compute_ms"] == 0.05
    assert one["idle_ms"] == 0 and one["exposed_comm_ms"] == 0.03
    assert zero["collectives"] == {"recv": dict(calls=1, in_bytes=0, out_bytes=128)}
    assert one["collectives"] == {"send": dict(calls=1, in_bytes=128, out_bytes=0)}
    for step in (zero, one):
        parts = step["compute_ms"] + step["overlapped_comm_ms"] + step["exposed_comm_ms"] + step["idle_ms"]
        assert abs(parts - step["step_ms"]) < 1e-9
    assert ranks[0]["flop_per_s"] == 1000 / 110e-6


def test_a_collective_under_compute_is_overlapped(tmp_path):
    # DDP's form: the gradient's all-reduce runs on gloo's thread (2) while the backward goes on (thread 1).
    for rank in (0, 1):
        write_rank(tmp_path, rank, [
            op("autograd::engine::evaluate_function: AddmmBackward0", 1, 1, 79),
            op("gloo:all_reduce", 2, 20, 40, "user_annotation", **{"Input Dims": [[1000]], "Input type": ["float"]}),
            op("gloo:all_gather", 2, 60, 10, "user_annotation", **{"Input Dims": [[10]], "Input type": ["c10::BFloat16"]}),
            op("Optimizer.step#SGD.step", 1, 80, 20)])
    step = step_of(anatomy.analyse(tmp_path, 2)[0], 0)
    assert step["overlapped_comm_ms"] == 0.05 and step["exposed_comm_ms"] == 0 and step["idle_ms"] == 0
    assert step["collectives"]["all_reduce"] == dict(calls=1, in_bytes=4000, out_bytes=4000)
    assert step["collectives"]["all_gather"] == dict(calls=1, in_bytes=20, out_bytes=40)


def test_on_a_gpu_the_kernels_time_it_and_record_param_comms_counts_it(tmp_path):
    # NCCL's form: bytes from the CPU's record_param_comms, time from the kernels, the CPU only launching.
    comms = {"Collective name": "reduce_scatter", "In msg nelems": 1000, "Out msg nelems": 500, "dtype": "Float"}
    for rank in (0, 1):
        write_rank(tmp_path, rank, [
            op("aten::mm", 1, 1, 5), op("record_param_comms", 1, 6, 2, **comms),
            op("Optimizer.step#SGD.step", 1, 90, 5),
            op("void gemm_kernel", 7, 10, 40, "kernel"),
            op("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 8, 30, 40, "kernel")])
    ranks, parts = anatomy.analyse(tmp_path, 2)
    step = step_of(ranks, 0)
    assert step["collectives"] == {"reduce_scatter": dict(calls=1, in_bytes=4000, out_bytes=2000)}
    assert (step["compute_ms"], step["overlapped_comm_ms"], step["exposed_comm_ms"]) == (0.02, 0.02, 0.02)
    assert step["idle_ms"] == 0.035  # 0-95 us: 55 without a kernel, 20 of them in NCCL's
    anatomy.draw_timeline(tmp_path / "timeline.png", parts, "stand-in GPU")
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_a_plain_run_pays_nothing_for_the_profiler():
    """The start-up hook imports neither torch nor the profiler unless a tool asks: ANATOMY_OUT unset."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tools" / "copy_hook"))
    env.pop("ANATOMY_OUT", None)
    env.pop("CHECK_COPY_OUT", None)
    out = subprocess.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_bad_input_is_one_line(capsys):
    assert anatomy.main(["13_nothing.py"]) == 2
    assert anatomy.main(["10_pipeline_parallel.py", "--nproc", "3"]) == 2
    assert anatomy.main(["03_ddp_launch.py", "--steps", "0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines)


def test_the_harness_measures_each_mode_at_the_largest_n_it_ran():
    from bench.family import MODES
    from bench.plan import Settings
    cpu = Settings(gpus=[], max_n=2, per_device_batches=[64], epochs=1, epoch_images=0, test_batch_size=1000, seed=1,
                   synthetic=True, data_dir="data", target_acc=0.98, timeout=None, cores=2)
    gpus = dataclasses.replace(cpu, gpus=["0", "1", "2"], max_n=3)
    assert [anatomy.sweep_n(MODES[m], cpu) for m in ("single", "dp", "ddp_launch", "fsdp_tp")] == [1, 1, 2, 4]
    # On three GPUs: 02 at 3, 09 at 2 (128 / 3 is not whole), and 11 cannot run on 4 of them.
    assert [anatomy.sweep_n(MODES[m], gpus) for m in ("dp", "tensor_parallel", "fsdp_tp")] == [3, 2, None]
