"""A prediction of E(n), each mode's scaling efficiency at n = 2, 4 and 8, from what one machine measured.

    python -m bench.measure.scaling --from results/cpu-2core-amd-epyc-anatomy          # that machine, more ranks
    python -m bench.measure.scaling --from results/cpu-2core-amd-epyc-anatomy \\
        --step-ms 1.72 --busbw 100 --cores 16 --json e8.json                         # 8 GPUs with NVLink

It predicts; it measures nothing. --from is a sweep made with `bench/run_all.py --anatomy`. It gives:

- 01's step, t1: its batch over its samples/s (summary.csv);
- each mode's step at the sweep's n, split by the anatomy: compute, communication, idle;
- the link: the all-reduce of the gradient (allreduce-n2.json), or --busbw in GB/s where there are no n devices.

For mode m at n ranks, a step takes compute + communication + idle:

- compute = t1 x r x w(n) x h(n). r is the mode's compute over 01's, both profiled alike. w(n) is the share of
  a batch a rank computes: 1 in data parallelism, 2 / n in 09, constant in 11. h(n) is how much slower a rank
  computes with fewer cores: n ranks on C cores have C / n each.
- communication = what a rank's collectives take: the bytes the anatomy saw, over the link, through a ring, whose
  time grows as (n - 1) / n. A CPU has no spare core, so it all counts. A GPU hides what overlapped at the
  sweep's n, and what the anatomy saw exposed stays exposed.
- idle: waiting on other ranks, as at the sweep's n. On other devices: 0, unmeasured, so the prediction there is
  an upper bound: stragglers and launch jitter only lower it.
- 10 instead: its two stages do unequal work, and each microbatch passes both. So its step is the busiest
  stage's compute, (m + p - 1) / m times over: the GPipe bubble of p stages and m microbatches. Its sends
  overlap the other stage's work: they count only at --busbw.

E(n) = X(n) / (ideal x X(01)), as the harness reports it: ideal is n on n devices, 1 where ranks share cores.
"""
import argparse
import csv
import json
import os
import sys

from bench.family import MODES, REPO, load_script
from bench.machine import environment
from bench.outputs import write_json

NS = (2, 4, 8)
# DDP, FSDP2, tensor and pipeline parallel, the 2-D mesh. 04-07 are 03 started otherwise; 12 is 08 with snapshots.
MODELLED = ("ddp_launch", "fsdp", "tensor_parallel", "pipeline_parallel", "fsdp_tp")


def ring(n):
    """A ring all-reduce sends 2 (n - 1) / n of the buffer a rank holds; all-gathers and reduce-scatters half."""
    return (n - 1) / n


def read_sweep(folder):
    """01's step in ms and batch, each mode's anatomy at its n, and the gradient all-reduce's ms at 2 ranks; None
    for a sweep without 01 or without its anatomy, the reference of every prediction."""
    with open(os.path.join(folder, "summary.csv"), newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["variant"] == "base"]
    single = next((r for r in rows if r["mode"] == "single"), None)
    if single is None or not os.path.exists(os.path.join(folder, "anatomy", "01", "anatomy.json")):
        return None
    batch = int(single["per_device_batch"])
    t1 = batch / float(single["samples_per_s"]) * 1e3
    anatomy = {}
    for mode in MODES.values():
        path = os.path.join(folder, "anatomy", mode.number, "anatomy.json")
        if os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
            steps = [s for rank in result["per_rank"] for s in rank["steps"]]
            mean = {k: sum(s[k] for s in steps) / len(steps)
                    for k in ("step_ms", "compute_ms", "overlapped_comm_ms", "exposed_comm_ms", "idle_ms")}
            mean["bytes"] = sum(c["in_bytes"] for s in steps for c in s["collectives"].values()) / len(steps)
            # A pipeline goes at its slowest stage: the busiest rank's compute, not the mean of the ranks'.
            mean["busiest_ms"] = max(sum(s["compute_ms"] for s in r["steps"]) / len(r["steps"])
                                     for r in result["per_rank"])
            if mode.name == "pipeline_parallel":  # its --microbatches, as the anatomy ran it
                mean["microbatches"] = load_script(mode.script).parse_args(result["script_flags"]).microbatches
            anatomy[mode.name] = dict(mean, n=result["ranks"])
    allreduce = None
    if os.path.exists(os.path.join(folder, "allreduce-n2.json")):
        with open(os.path.join(folder, "allreduce-n2.json")) as f:
            allreduce = json.load(f)["gradient_row"]["time_us"] / 1e3
    return dict(t1_ms=t1, batch=batch, anatomy=anatomy, allreduce_ms=allreduce, cores=None)


def work_share(name, n, n0):
    """w(n) / w(n0): how a rank's share of the computing changes from the sweep's n to n."""
    return {"tensor_parallel": n0 / n}.get(name, 1.0)


def predict(sweep, name, n, cores=None, step_ms=None, busbw=None):
    """{step_ms, e_n} of mode `name` at n ranks; None where the mode cannot run at n (10: two stages)."""
    a, mode = sweep["anatomy"][name], MODES[name]
    n0, single = a["n"], sweep["anatomy"]["single"]
    if (name == "pipeline_parallel" and n != n0) or n < n0:  # 10 has two stages; 11 ran at 4 ranks
        return None
    device = step_ms is not None  # another device: one per rank, and its own step time for 01
    t1 = step_ms if device else sweep["t1_ms"]
    r = a["compute_ms"] / single["compute_ms"]
    if device:  # on the sweep's CPU each rank had fewer cores than 01: DDP's ratio there is that alone
        r /= sweep["anatomy"]["ddp_launch"]["compute_ms"] / single["compute_ms"]
    shared = not device and cores is not None
    h = max(1.0, n / cores) / max(1.0, n0 / cores) if shared else max(1.0, n / (cores or n))
    comm = a["overlapped_comm_ms"] + a["exposed_comm_ms"]
    if busbw:  # the bytes a rank handed in, taken as a ring all-reduce's: 2 (n - 1) / n of them over busbw
        comm = a["bytes"] * 2 * ring(n) / (busbw * 1e9) * 1e3
    else:
        comm *= ring(n) / ring(n0)
    if device:  # a GPU's copy engines and NCCL's kernels overlap; what was exposed stays so
        comm *= a["exposed_comm_ms"] / max(1e-9, a["overlapped_comm_ms"] + a["exposed_comm_ms"])
    else:
        comm *= h  # gloo reduces on the same cores
    idle = 0.0 if device else a["idle_ms"]
    step = t1 * r * work_share(name, n, n0) * h + comm + idle
    if name == "pipeline_parallel":  # the slowest stage, once per microbatch, and the bubble: (p - 1) of them more
        m = a["microbatches"]
        step = t1 * r * a["busiest_ms"] / a["compute_ms"] * h * (m + n - 1) / m + (comm if busbw else 0.0)
    global_batch = mode.batch.global_batch(sweep["batch"], n)
    ideal = n if device or cores is None or n <= 1 else 1
    return dict(step_ms=step, e_n=global_batch / step / (ideal * sweep["batch"] / t1))


def table(sweep, cores=None, step_ms=None, busbw=None):
    """{mode: {n: E(n) or None}} for each modelled mode the sweep's anatomy has."""
    return {name: {n: (predict(sweep, name, n, cores, step_ms, busbw) or {}).get("e_n") for n in NS}
            for name in MODELLED if name in sweep["anatomy"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="folder", required=True, help="a sweep's folder, made with run_all.py --anatomy")
    p.add_argument("--cores", type=int, help="the host's cores (default: the sweep's, if on the CPU)")
    p.add_argument("--step-ms", type=float, help="01's step on one of the devices predicted for: ranks on devices")
    p.add_argument("--busbw", type=float, help="the link's bus bandwidth, GB/s, where n devices are not there")
    p.add_argument("--json", help="write the prediction and its inputs here")
    args = p.parse_args(argv)
    if not os.path.exists(os.path.join(args.folder, "summary.csv")):
        sys.exit(f"error: {args.folder} has no summary.csv: give a folder that bench/run_all.py wrote")
    sweep = read_sweep(args.folder)
    if sweep is None or "ddp_launch" not in sweep["anatomy"]:
        sys.exit(f"error: {args.folder} has no anatomy of 01 and 03: run bench/run_all.py with 01, 03 and --anatomy")
    with open(os.path.join(args.folder, "env.json")) as f:
        cores = args.cores or (json.load(f).get("cpu_cores") if args.step_ms is None else None)
    predicted = table(sweep, cores, args.step_ms, args.busbw)
    link = f"--busbw {args.busbw} GB/s (given)" if args.busbw else "the links the sweep measured"
    where = f"one device a rank, 01's step {args.step_ms} ms (given)" if args.step_ms else f"{cores} shared cores"
    print(f"PREDICTED E(n), not measured: {where}; {link}; from {args.folder}"
          + ("; idle unmeasured: upper bounds" if args.step_ms else ""))
    print(f"{'mode':<20}" + "".join(f"{'E(' + str(n) + ')':>8}" for n in NS))
    for name, row in predicted.items():
        print(f"{name:<20}" + "".join(f"{'-' if e is None else f'{e:.2f}':>8}" for e in row.values()))
    if args.json:
        write_json(args.json, dict(prediction=True, source=args.folder, cores=cores, step_ms=args.step_ms,
                                   busbw_gb_s=args.busbw, t1_ms=sweep["t1_ms"], e_n=predicted,
                                   argv=sys.argv if argv is None else argv))
        # The machine and versions that computed it, beside it, as the other tools write theirs.
        write_json(os.path.join(os.path.dirname(os.path.abspath(args.json)), "env.json"), environment(REPO, []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
