"""All-reduce time and bandwidth over message sizes and at the model's gradient size: what DDP pays per step.

    python -m bench.measure.allreduce --nprocs 2 --cpu --json allreduce.json   # gloo, 2 CPU processes
    python -m bench.measure.allreduce --nprocs 4                               # NCCL on 4 GPUs (gloo without NCCL)

Each size: --warmup untimed calls, then --iters timed, each after a barrier; a call takes its slowest rank's time,
the median counts. algbw = bytes / time; busbw = algbw x 2(n-1)/n (nccl-tests'): comparable with link bandwidth.
"""
import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.flags import in_range
from bench.outputs import write_json
from bench.machine import cpu_cores, environment, free_port
from bench.family import REPO, load_script

FP32_BYTES = 4


def time_size(nbytes, device, args):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda device: None)
    tensor = torch.ones(nbytes // FP32_BYTES, dtype=torch.float32, device=device)
    times = []
    for _ in range(args.warmup + args.iters):  # the warm-up calls set up connections, buffers and kernels
        dist.barrier()  # every rank starts together: no call times another rank's late arrival
        sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(tensor)
        sync(device)  # NCCL returns before the data has moved: read the clock once it has
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times[args.warmup:], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    seconds, n = statistics.median(slowest.tolist()), args.nprocs
    return dict(bytes=nbytes, time_us=seconds * 1e6, algbw_gb_s=nbytes / seconds / 1e9,
                busbw_gb_s=nbytes / seconds / 1e9 * 2 * (n - 1) / n)


def backend_for(device):
    """The scripts' choice: the device's default backend, or gloo where it is not built in (Windows has no NCCL)."""
    backend = dist.get_default_backend_for_device(device)
    return backend if dist.is_backend_available(backend) else "gloo"


def sharing_one_gpu(rank):
    """What a rank needs to share a GPU with another: NCCL takes them for two hosts, joined over loopback (NCCL
    2.30 allows it; NCCL_HOSTID makes older versions take it too: tests/integration/test_gpu.py)."""
    return {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_HOSTID": f"rank-{rank}-of-one-gpu", "NCCL_SOCKET_IFNAME": "lo"}


def worker(rank, args, params):
    gpus = 0 if args.cpu else torch.cuda.device_count()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", rank % gpus if gpus else rank)
    if 0 < gpus < args.nprocs:  # more ranks than GPUs: each still runs its all-reduce through NCCL
        os.environ.update(sharing_one_gpu(rank))
    torch.set_num_threads(max(1, cpu_cores() // args.nprocs))  # the scripts' rule: cores / processes
    dist.init_process_group(backend_for(device), rank=rank, world_size=args.nprocs,
                            timeout=timedelta(seconds=60), device_id=None if args.cpu else device)
    try:
        gradient = params * FP32_BYTES
        sizes = {gradient} | {args.min_bytes * 4 ** k // FP32_BYTES * FP32_BYTES for k in range(32)
                              if args.min_bytes * 4 ** k <= args.max_bytes}
        rows = [dict(time_size(nbytes, device, args), gradient=nbytes == gradient) for nbytes in sorted(sizes)]
        if rank == 0:
            report(args, rows, dist.get_backend(), device, params)
    finally:
        dist.destroy_process_group()


def report(args, rows, backend, device, params):
    import pandas as pd
    print(f"all-reduce (sum, fp32), {backend}, {args.nprocs} ranks on {device.type}; median of {args.iters} iterations"
          f" after {args.warmup} warm-up, slowest rank; the model's gradient is {params * FP32_BYTES:,} bytes")
    print(pd.DataFrame(rows).to_string(index=False, float_format="{:,.3f}".format), flush=True)
    if args.json:  # the results, then (unless --no-env) the environment they were measured in
        gradient_row = next(r for r in rows if r["gradient"])
        write_json(args.json, dict(backend=backend, world_size=args.nprocs, device_type=device.type, iters=args.iters,
                                   warmup=args.warmup, model_parameters=params, gradient_bytes=gradient_row["bytes"],
                                   gradient_row=gradient_row, rows=rows, argv=sys.argv))
        if not args.no_env:
            gpus = [(str(i), "") for i in range(args.nprocs)] if device.type == "cuda" else []
            write_json(os.path.join(os.path.dirname(os.path.abspath(args.json)), "env.json"), environment(REPO, gpus))


def main(argv=None):
    m01 = load_script()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=in_range(1), default=2, help="processes, one per GPU, or sharing (default 2)")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU (default: a GPU each, NCCL where torch has it)")
    p.add_argument("--min-bytes", type=in_range(4), default=4 << 10, help="smallest message (default 4 KiB)")
    p.add_argument("--max-bytes", type=in_range(4), default=64 << 20, help="largest message (default 64 MiB)")
    p.add_argument("--warmup", type=in_range(0), default=5, help="untimed iterations per size (default 5)")
    p.add_argument("--iters", type=in_range(1), default=20, help="timed iterations per size (default 20)")
    p.add_argument("--json", type=m01.writable, metavar="PATH", help="rank 0 writes results here, env.json beside it")
    p.add_argument("--no-env", action="store_true", help="no env.json beside --json (the harness writes its own)")
    args = p.parse_args(argv)
    params = sum(param.numel() for param in m01.Net().parameters())  # counted here: the ranks need not load 01
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))  # several runs may share a host
    mp.spawn(worker, args=(args, params), nprocs=args.nprocs)


if __name__ == "__main__":
    main()
