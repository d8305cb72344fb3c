"""All-reduce time, algorithm bandwidth and bus bandwidth over message sizes: what DDP pays per step.

    python -m bench.measure.allreduce --nprocs 2 --cpu --json allreduce.json   # gloo, 2 CPU processes
    torchrun --standalone --nproc_per_node 4 -m bench.measure.allreduce       # NCCL on 4 GPUs

Sizes: powers of 4 from --min-bytes to --max-bytes plus the fp32 gradient of 01's Net (what DDP all-reduces
every step, in buckets). Each size is all-reduced --warmup times untimed, then --iters times one by one
after a barrier, the device synchronised before each clock read; an iteration counts with its slowest
rank's time and the median iteration is reported. algbw = bytes / time, busbw = algbw x 2(n-1)/n (as
nccl-tests defines them: what each link carries in a ring, comparable with the hardware whatever n is).
"""
import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

from bench.files import json_path, write_json
from bench.machine import cpu_cores, environment, free_port
from bench.scripts import REPO, load_script

FP32_BYTES = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=int, default=2, help="processes to spawn (ignored under torchrun; default 2)")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto", help="auto: nccl on GPUs, else gloo")
    p.add_argument("--cpu", action="store_true", help="ignore GPUs (gloo)")
    p.add_argument("--min-bytes", type=int, default=4 << 10, help="smallest message (default 4 KiB)")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="largest message (default 64 MiB)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per size (default 5)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size; the median counts (default 20)")
    p.add_argument("--timeout", type=float, default=300, help="seconds before a missing peer is an error")
    p.add_argument("--json", type=json_path, metavar="PATH", help="rank 0 writes the results here, env.json beside it")
    p.add_argument("--no-env", action="store_true", help="no env.json beside --json (the harness writes its own)")
    return p.parse_args(argv)


def sizes(min_bytes, max_bytes, gradient):
    """Powers of 4 times min_bytes up to max_bytes, each a whole number of fp32 values, and the gradient."""
    out = {gradient} | {max(FP32_BYTES, min_bytes * 4 ** k // FP32_BYTES * FP32_BYTES)
                        for k in range(32) if min_bytes * 4 ** k <= max_bytes}
    return sorted(out)


def time_size(nbytes, device, args):
    """Median over --iters of the slowest rank's seconds for one all-reduce of nbytes."""
    import torch
    import torch.distributed as dist
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda device: None)
    tensor = torch.ones(nbytes // FP32_BYTES, dtype=torch.float32, device=device)
    for _ in range(args.warmup):  # first calls set up connections, buffers and kernels
        dist.all_reduce(tensor)
    times = []
    for _ in range(args.iters):
        dist.barrier()  # every rank starts together: no iteration times another rank's late arrival
        sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(tensor)
        sync(device)  # NCCL returns before the data has moved: read the clock once it has
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def worker(local_rank, args, world_size, params, rank_offset=0):
    """One rank: join the group, time every size; rank 0 reports."""
    import torch
    import torch.distributed as dist
    cuda = args.backend == "nccl" or (args.backend == "auto" and not args.cpu and torch.cuda.is_available())
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    torch.set_num_threads(max(1, cpu_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank_offset + local_rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout), device_id=device if cuda else None)
    try:
        gradient = params * FP32_BYTES
        rows = []
        for nbytes in sizes(args.min_bytes, args.max_bytes, gradient):
            algbw = nbytes / time_size(nbytes, device, args) / 1e9
            rows.append(dict(bytes=nbytes, time_us=nbytes / algbw / 1e3, algbw_gb_s=algbw, gradient=nbytes == gradient,
                             busbw_gb_s=algbw * 2 * (world_size - 1) / world_size))
        if rank_offset + local_rank == 0:
            report(args, rows, world_size, dist.get_backend(), device, params)
    finally:
        dist.destroy_process_group()


def report(args, rows, n, backend, device, params):
    print(f"all-reduce (sum, fp32), {backend}, {n} ranks on {device.type}; median of {args.iters} iterations after "
          f"{args.warmup} warm-up, slowest rank\n{'bytes':>12} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    for r in rows:
        print(f"{r['bytes']:>12,} {r['time_us']:>12,.1f} {r['algbw_gb_s']:>13.3f} {r['busbw_gb_s']:>13.3f}"
              + ("   <- the model's gradient (fp32)" if r["gradient"] else ""), flush=True)
    if args.json:  # the figures, then (unless --no-env) the environment they were measured in
        gradient_row = next(r for r in rows if r["gradient"])
        write_json(args.json, dict(backend=backend, world_size=n, device_type=device.type, iters=args.iters,
                                   warmup=args.warmup, model_parameters=params, gradient_bytes=gradient_row["bytes"],
                                   gradient_row=gradient_row, rows=rows, argv=sys.argv))
        if args.no_env:
            return
        gpus = (os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(n)))).split(",")
        write_json(os.path.join(os.path.dirname(os.path.abspath(args.json)), "env.json"),
                   environment(REPO, [(g, "") for g in gpus] if device.type == "cuda" else []))


def main(argv=None):
    args = parse_args(argv)
    params = sum(p.numel() for p in load_script().Net().parameters())  # built once: ranks need torch only
    if "LOCAL_RANK" in os.environ:  # under torchrun: it started the processes and set the rendezvous
        local_rank = int(os.environ["LOCAL_RANK"])
        return worker(local_rank, args, int(os.environ["WORLD_SIZE"]), params, int(os.environ["RANK"]) - local_rank)
    import torch.multiprocessing as mp
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))  # several runs may share a host
    mp.spawn(worker, args=(args, args.nprocs, params), nprocs=args.nprocs)


if __name__ == "__main__":
    main()
