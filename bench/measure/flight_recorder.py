"""A planted desync at two ranks, and what torch's flight recorder says about it.

    python -m bench.measure.flight_recorder --out fr        # NCCL on the GPU (two ranks may share one)
    python -m bench.measure.flight_recorder --cpu --out fr  # gloo on the CPU

A desync is ranks that call different collectives. Here both ranks all-reduce once. Then rank 0 all-reduces
again and rank 1 skips it, as if it had taken another branch. Rank 0 waits until its timeout.

Each rank records its collectives in the flight recorder, a ring buffer in memory (TORCH_FR_BUFFER_SIZE). At the
timeout the records are dumped to --out, one file a rank. NCCL's watchdog dumps rank 0's itself
(TORCH_NCCL_DUMP_ON_TIMEOUT); the other dumps are written by the ranks. Then torch's analyser,
`python -m torch.distributed.flight_recorder.fr_trace`, reads them all. Its verdict goes to the screen and to
--out/analysis.txt. Exit status 0 if it names rank 1 as missing from an all-reduce, 1 if not.
"""
import argparse
import datetime
import os
import pickle
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from bench.machine import free_port
from bench.measure.allreduce import sharing_one_gpu

RANKS = 2
TIMEOUT_S = 5  # how long rank 0 waits in the all-reduce that rank 1 skipped
WAIT_S = TIMEOUT_S + 45  # for both ranks to dump and end: start-up, the timeout, the watchdog's dump
PREFIX = "rank_"  # a dump is --out/rank_R, the analyser's --prefix
NAMED = "missing ranks: {1}"  # how the analyser names the rank that skipped


def rank_main(rank, port, out, cpu):
    """One rank of the desync, started by main()."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(RANKS))
    device = torch.device("cpu") if cpu else torch.device("cuda", rank % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl", timeout=datetime.timedelta(seconds=TIMEOUT_S),
                            device_id=None if cpu else device)
    tensor = torch.ones(4, device=device)
    dist.all_reduce(tensor)
    path = os.path.join(out, f"{PREFIX}{rank}")
    if rank == 0:
        try:
            dist.all_reduce(tensor)
            # On NCCL the call returns at once; reading the sum waits, until the watchdog dumps and aborts.
            tensor.sum().item()
        except RuntimeError as e:
            print(f"rank 0: {str(e).strip().splitlines()[-1][:200]}", flush=True)
    if not os.path.exists(path):  # rank 1's record is whole: it skips the rest
        c10d = torch._C._distributed_c10d
        with open(path, "wb") as f:
            f.write(c10d._dump_fr_trace() if cpu else c10d._dump_nccl_trace())
    print(f"rank {rank}: wrote {path}", flush=True)
    # Rank 1 stays until rank 0 has dumped: had it ended, rank 0 would see a closed connection, not a hang.
    for _ in range(WAIT_S * 10 if rank == 1 else 0):
        if os.path.exists(os.path.join(out, f"{PREFIX}0")):
            break
        time.sleep(0.1)
    os._exit(0)  # the group is broken: destroying it could wait on the peer


def rank_env(rank, out, cpu):
    env = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
           "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(out, PREFIX)}
    if not cpu and torch.cuda.device_count() < RANKS:
        env.update(sharing_one_gpu(rank))
    return {**os.environ, **env}


def agree(out):
    """gloo's dump names the default group '' in pg_config, '0' in its entries (torch 2.14.1). The analyser needs
    the two to agree: each group its entries name is added to pg_config, with every rank."""
    for rank in range(RANKS):
        path = os.path.join(out, f"{PREFIX}{rank}")
        with open(path, "rb") as f:
            dump = pickle.load(f)
        for entry in dump.get("entries", []):
            name, desc = entry["process_group"]
            every = str(list(range(RANKS)))
            dump["pg_config"].setdefault(name, dict(name=name, desc=desc, ranks=every))
        with open(path, "wb") as f:
            pickle.dump(dump, f)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="flight-recorder", help="where the dumps and analysis.txt go")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU, even where there is a GPU")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out, cpu = os.path.abspath(args.out), args.cpu or not torch.cuda.is_available()
    if args.rank is not None:
        return rank_main(args.rank, args.port, out, cpu)
    os.makedirs(out, exist_ok=True)
    for rank in range(RANKS):  # an earlier run's dump must not pass for this one's
        if os.path.exists(os.path.join(out, f"{PREFIX}{rank}")):
            os.remove(os.path.join(out, f"{PREFIX}{rank}"))
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-m", "bench.measure.flight_recorder", "--out", out, "--rank",
                               str(rank), "--port", str(port), *["--cpu"] * cpu], env=rank_env(rank, out, cpu))
             for rank in range(RANKS)]
    deadline = time.monotonic() + WAIT_S
    for process in ranks:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
    missing = [rank for rank in range(RANKS) if not os.path.exists(os.path.join(out, f"{PREFIX}{rank}"))]
    if missing:
        print(f"error: no flight record of rank {missing[0]} in {out} after {WAIT_S} s", file=sys.stderr)
        return 1
    agree(out)
    analysis = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", out,
                               "--prefix", PREFIX], capture_output=True, text=True, timeout=120)
    text = analysis.stdout + analysis.stderr
    with open(os.path.join(out, "analysis.txt"), "w") as f:
        f.write(text)
    print(text.strip())
    named = NAMED in text and "all_reduce" in text
    print(f"{'the analyser names' if named else 'NOT NAMED:'} rank 1, missing from rank 0's second all-reduce "
          f"({'gloo' if cpu else 'NCCL'}); {out}/analysis.txt")
    return 0 if named else 1


if __name__ == "__main__":
    sys.exit(main())
