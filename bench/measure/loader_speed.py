"""How fast the scripts' own input pipeline is, alone, next to how fast 01 trains.

    python -m bench.measure.loader_speed --synthetic --cpu --json loader.json

It loads the data and draws 01_single_gpu.py's batches exactly as its run() does, for --passes whole
epochs and nothing else (warm-up left out, device synchronised before each clock read; the median epoch
counts); then it times --train-steps steps of 01's own train_epoch(). The
input pipeline is not what the suite measures when the loader alone is REQUIRED_RATIO times faster.
"""
import argparse
import statistics
import sys
import time

from bench.files import json_path, write_json
from bench.scripts import load_script

REQUIRED_RATIO = 50  # loader samples/s over training samples/s


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data", help="torchvision's MNIST folder (as 01's --data-dir)")
    p.add_argument("--synthetic", action="store_true", help="random MNIST-shaped data (as 01's --synthetic)")
    p.add_argument("--cpu", action="store_true", help="ignore GPUs")
    p.add_argument("--batch-size", type=int, default=64, help="01's --batch-size (default 64)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: as 01, every core)")
    p.add_argument("--passes", type=int, default=5, help="timed epochs of the loader; the median counts (default 5)")
    p.add_argument("--train-steps", type=int, default=30, help="steps of 01's train_epoch to time; 0: loader only")
    p.add_argument("--json", type=json_path, metavar="PATH", help="write the figures here")
    return p.parse_args(argv)


def loader_pass(m01, data, sampler, args, device, warmup):
    """Samples/s of one epoch of 01's batches(): fetch each batch on the device, nothing else."""
    samples, t0 = 0, None
    for i, (images, labels) in enumerate(m01.batches(data, list(sampler), args.batch_size)):
        if i == warmup:
            m01.synchronize(device)  # GPU work is asynchronous: read the clock once it is done
            t0 = time.perf_counter()
        samples += len(labels) if i >= warmup else 0
    m01.synchronize(device)
    return samples / (time.perf_counter() - t0)


def measure(args):
    import torch
    m01 = load_script()
    a = m01.parse_args(["--batch-size", str(args.batch_size), "--threads", str(args.threads), "--log-interval", "0",
                        "--max-steps", str(args.train_steps), "--data-dir", args.data_dir]
                       + ["--synthetic"] * args.synthetic + ["--cpu"] * args.cpu)  # what a run of 01 sees
    ctx = m01.setup(a)  # device and threads by 01's own rule
    device = ctx["device"]
    data = [t.to(device) for t in m01.load_mnist(a, train=True)]  # as 01's run() does
    sampler = m01.DistributedSampler(range(len(data[1])), num_replicas=1, rank=0, seed=a.seed)
    warmup = min(m01.WARMUP_STEPS, len(sampler) // a.batch_size - 1)  # the same warm-up as 01's training
    speeds = []
    for epoch in range(1, args.passes + 1):
        sampler.set_epoch(epoch)
        speeds.append(loader_pass(m01, data, sampler, a, device, warmup))
    training = None
    if args.train_steps:  # 01's own samples/s rule: warm-up left out, synchronised
        torch.manual_seed(a.seed)
        model = m01.Net(dropout=not a.no_dropout).to(device)
        optimizer = torch.optim.Adadelta(model.parameters(), lr=a.lr)
        train = m01.train_epoch(model, data, sampler, optimizer, a, ctx, 1)
        training = train["steady_samples"] / train["steady_time_s"]
    speed = statistics.median(speeds)
    return dict(loader_samples_per_s=speed, loader_passes_samples_per_s=speeds, train_samples_per_s=training,
                ratio=speed / training if training else None, required_ratio=REQUIRED_RATIO, device=str(device),
                threads=ctx["threads"], batch_size=a.batch_size, train_samples=len(sampler), warmup_batches=warmup,
                synthetic=a.synthetic, data_dir=None if a.synthetic else a.data_dir, argv=sys.argv)


def main(argv=None):
    args = parse_args(argv)
    r = measure(args)
    line = f"loader alone: {r['loader_samples_per_s']:,.0f} samples/s on {r['device']} (batch {r['batch_size']}, " \
           f"median of {args.passes} epochs)"
    if r["ratio"]:
        line += f" = {r['ratio']:,.0f} x 01's training throughput ({r['train_samples_per_s']:,.0f} samples/s); " \
                f"requirement >= {REQUIRED_RATIO}x: {'met' if r['ratio'] >= REQUIRED_RATIO else 'NOT met'}"
    print(line, flush=True)
    if args.json:
        write_json(args.json, r)


if __name__ == "__main__":
    main()
