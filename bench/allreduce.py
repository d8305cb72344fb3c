"""All-reduce time, algorithm bandwidth and bus bandwidth over message sizes: what DDP pays per step.

    python bench/allreduce.py --nprocs 2                                   # gloo on the CPU, or NCCL on 2 GPUs
    python bench/allreduce.py --nprocs 2 --cpu --json results/cpu-pipeline/allreduce.json
    torchrun --standalone --nproc_per_node 4 bench/allreduce.py            # the same, started by torchrun

Sizes: powers of 4 from --min-bytes to --max-bytes (4 KiB .. 64 MiB) plus the gradient of the suite's model
(01's Net in fp32, 4 x its parameter count: what DDP all-reduces every step, in buckets). Each size is
all-reduced (sum, fp32) --warmup times untimed, then --iters times timed one by one: the ranks meet at a
barrier, the device is synchronised before each clock read, each iteration counts with its slowest rank's
time (all_reduce MAX of the per-rank times), and the median iteration is reported.
    algbw = bytes / time        busbw = algbw x 2(n-1)/n   (as nccl-tests defines them)
busbw is what each rank's link carries in a ring all-reduce, so it compares with the hardware's bandwidth
whatever n is. Backend: --backend auto is nccl on GPUs and gloo on the CPU (or with --cpu).
With --json, rank 0 writes the table there and env.json (bench/envinfo.py) beside it (not with --no-env).

bench/run_all.py runs it once per n >= 2 of a sweep, at the gradient size only (sweep_figures below), for
the limit model in report.md.
"""
import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling modules, from any working directory

import envinfo  # noqa: E402
from files import read_json, write_json  # noqa: E402
from loader_speed import REPO, check_json_path, load_script  # noqa: E402
import sweep  # noqa: E402

FP32_BYTES = 4
# For the harness: a few seconds per n. 4 KiB (the latency) is the smallest size; the gradient is always added.
SWEEP_ARGS = ["--min-bytes", "4096", "--max-bytes", "4096", "--warmup", "3", "--iters", "10", "--timeout", "60"]
SWEEP_TIMEOUT_S = 120


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=int, default=2, help="processes to spawn (ignored under torchrun; default 2)")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--cpu", action="store_true", help="ignore GPUs (gloo)")
    p.add_argument("--min-bytes", type=int, default=4 << 10, help="smallest message (default 4 KiB)")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="largest message (default 64 MiB)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per size (default 5)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size; the median counts (default 20)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per process (default: cores / processes)")
    p.add_argument("--timeout", type=float, default=300, help="seconds before a missing peer is an error")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the results here, and env.json beside it")
    p.add_argument("--no-env", action="store_true", help="no env.json beside --json (the harness writes its own)")
    args = p.parse_args(argv)
    if min(args.nprocs, args.iters, args.min_bytes) < 1 or args.warmup < 0 or args.threads < 0:
        p.error("--nprocs, --iters and --min-bytes must be positive, --warmup and --threads zero or positive")
    if args.max_bytes < args.min_bytes:
        p.error("--max-bytes must be at least --min-bytes")
    return args


def gradient_bytes():
    """fp32 bytes of the gradient of the suite's model (01's Net): 1,199,882 parameters -> 4,799,528."""
    params = sum(p.numel() for p in load_script().Net().parameters())
    return params, params * FP32_BYTES


def sizes(min_bytes, max_bytes, extra):
    """Powers of 4 times min_bytes up to max_bytes, each a whole number of fp32 values, plus `extra`."""
    out, size = {extra}, min_bytes
    while size <= max_bytes:
        out.add(max(FP32_BYTES, size // FP32_BYTES * FP32_BYTES))
        size *= 4
    return sorted(out)


def use_cuda(args):
    import torch
    return args.backend == "nccl" or (args.backend == "auto" and not args.cpu and torch.cuda.is_available())


def time_size(nbytes, device, args):
    """Median over --iters of the slowest rank's seconds for one all-reduce of nbytes."""
    import torch
    import torch.distributed as dist
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    tensor = torch.ones(nbytes // FP32_BYTES, dtype=torch.float32, device=device)
    for _ in range(args.warmup):  # first calls set up connections, buffers and kernels
        dist.all_reduce(tensor)
    times = []
    for _ in range(args.iters):
        dist.barrier()  # every rank starts together: no iteration times another rank's late arrival
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(tensor)
        sync()  # NCCL returns before the data has moved: read the clock once it has
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def row(nbytes, seconds, n, gradient):
    algbw = nbytes / seconds
    return dict(bytes=nbytes, time_us=seconds * 1e6, algbw_gb_s=algbw / 1e9, busbw_gb_s=algbw / 1e9 * 2 * (n - 1) / n,
                gradient=nbytes == gradient)


def table(rows):
    lines = [f"{'bytes':>12} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}"]
    for r in rows:
        lines.append(f"{r['bytes']:>12,} {r['time_us']:>12,.1f} {r['algbw_gb_s']:>13.3f} {r['busbw_gb_s']:>13.3f}"
                     + ("   <- the model's gradient (fp32)" if r["gradient"] else ""))
    return "\n".join(lines)


def worker(local_rank, args, world_size, model, rank_offset=0):
    """One rank: join the group, time every size, rank 0 reports. model: (parameters, gradient bytes)."""
    import torch
    import torch.distributed as dist
    rank = rank_offset + local_rank
    cuda = use_cuda(args)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    torch.set_num_threads(args.threads or max(1, envinfo.cpu_cores() // local_procs))  # the README's CPU rule
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=args.timeout),
                            device_id=device if cuda else None)
    try:
        params, gradient = model
        rows = [row(b, time_size(b, device, args), world_size, gradient)
                for b in sizes(args.min_bytes, args.max_bytes, gradient)]
        if rank == 0:
            report(args, rows, world_size, backend, device, params, gradient)
    finally:
        dist.destroy_process_group()


def report(args, rows, n, backend, device, params, gradient):
    import torch
    print(f"all-reduce (sum, fp32), {backend}, {n} ranks on {device.type}; median of {args.iters} iterations "
          f"after {args.warmup} warm-up, slowest rank; busbw = algbw x 2(n-1)/n")
    print(table(rows))
    grad = next(r for r in rows if r["gradient"])
    print(f"gradient of the model: {params:,} parameters = {gradient:,} bytes: {grad['time_us']:,.0f} us, "
          f"busbw {grad['busbw_gb_s']:.3f} GB/s", flush=True)
    if args.json:
        result = dict(backend=backend, world_size=n, device_type=device.type, iters=args.iters, warmup=args.warmup,
                      threads=torch.get_num_threads(), model_parameters=params, gradient_bytes=gradient,
                      gradient_row=grad, rows=rows, torch_version=torch.__version__, argv=sys.argv)
        write_json(args.json, result)
        if args.no_env:
            return
        visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(n)))
        write_json(os.path.join(os.path.dirname(os.path.abspath(args.json)), "env.json"),
                   envinfo.collect(REPO, visible.split(",") if device.type == "cuda" else []))


def sweep_figures(settings, repo, out_dir):
    """For bench/run_all.py: {n: this tool's result, or {'error': ...}} for every n >= 2 of the sweep.

    Each n is its own process group, started as a user would start it, with the sweep's backend (gloo with
    cores/n threads per rank on the CPU, NCCL on the first n GPUs) and killed whole on a timeout.
    """
    return {n: sweep_figure(settings, repo, out_dir, n) for n in sweep.gpu_counts(settings.max_n) if n >= 2}


def sweep_figure(settings, repo, out_dir, n):
    path = os.path.join(out_dir, f"allreduce-n{n}.json")
    log = os.path.join(out_dir, "logs", f"allreduce-n{n}.log")
    argv = [sys.executable, os.path.join(repo, "bench", "allreduce.py"), "--nprocs", str(n), "--json", path,
            "--no-env"] + SWEEP_ARGS + (["--cpu"] if settings.cpu else ["--backend", "nccl"])
    env = {"CUDA_VISIBLE_DEVICES": ",".join(settings.devices[:n])}
    if os.path.exists(path):
        os.remove(path)  # never report an earlier sweep's figure
    code, timed_out = sweep.execute([(env, argv)], repo, [log], SWEEP_TIMEOUT_S)
    if timed_out or code != 0:
        why = f"killed after {SWEEP_TIMEOUT_S} s" if timed_out else f"exit code {code}"
        return {"error": f"{why}: {sweep.log_tail([log], lines=1)} (log {os.path.relpath(log, out_dir)})"}
    return read_json(path) or {"error": f"no result in {path}"}


def main(argv=None):
    args = parse_args(argv)
    check_json_path(args.json)
    if "LOCAL_RANK" in os.environ:  # under torchrun: it started the processes and set the rendezvous
        world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        local_rank = int(os.environ["LOCAL_RANK"])
        return worker(local_rank, args, world_size, gradient_bytes(), rank_offset=rank - local_rank)
    import torch.multiprocessing as mp
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(sweep.free_port()))  # several runs may share a host
    # The model is built once here: the spawned ranks then need torch only, not 01 and torchvision.
    mp.spawn(worker, args=(args, args.nprocs, gradient_bytes()), nprocs=args.nprocs)


if __name__ == "__main__":
    main()
