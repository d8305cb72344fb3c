"""How fast the scripts' own input pipeline is, alone: the suite claims it is never what a run measures.

    python -m bench.measure.loader_speed --synthetic --cpu --json loader.json

It draws 01_single_gpu.py's batches exactly as its run() does, for --passes epochs and nothing else (warm-up left
out, the median epoch counts). The claim holds at REQUIRED_RATIO x the samples/s 01 prints, or more.
"""
import argparse
import statistics
import sys

from bench.flags import in_range
from bench.outputs import write_json
from bench.family import load_script

REQUIRED_RATIO = 50  # loader samples/s over training samples/s


def main(argv=None):
    m01 = load_script()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data", help="torchvision's MNIST folder (as 01's --data-dir)")
    p.add_argument("--synthetic", action="store_true", help="random MNIST-shaped data (as 01's --synthetic)")
    p.add_argument("--cpu", action="store_true", help="ignore GPUs")
    p.add_argument("--batch-size", type=in_range(1), default=64, help="01's --batch-size (default 64)")
    p.add_argument("--passes", type=in_range(1), default=5, help="timed epochs; the median counts (default 5)")
    p.add_argument("--json", type=m01.writable, metavar="PATH", help="write the results here (checked as 01 does)")
    args = p.parse_args(argv)
    a = m01.parse_args(["--batch-size", str(args.batch_size), "--data-dir", args.data_dir]
                       + ["--synthetic"] * args.synthetic + ["--cpu"] * args.cpu)  # what a run of 01 sees
    device = m01.setup(a).device  # 01's device, and its threads
    training, _ = m01.load_data(a, 0, 1, device)  # as 01's run() does
    steps = len(training(1))
    warmup = min(m01.WARMUP_STEPS, steps - 1)  # the same warm-up as 01's training
    speeds = []
    for epoch in range(1, args.passes + 1):
        for i, _ in enumerate(training(epoch)):
            if i == warmup:  # the clock starts once the warm-up batches are drawn
                t0 = m01.clock(device)
        speeds.append((steps - warmup) * a.batch_size / (m01.clock(device) - t0))  # full batches only
    result = dict(loader_samples_per_s=statistics.median(speeds), loader_passes_samples_per_s=speeds,
                  required_ratio=REQUIRED_RATIO, device=str(device), threads=m01.torch.get_num_threads(),
                  batch_size=a.batch_size, train_samples=steps * a.batch_size, warmup_batches=warmup,
                  synthetic=a.synthetic, argv=sys.argv)
    print(f"loader alone: {result['loader_samples_per_s']:,.0f} samples/s on {device} (batch {a.batch_size}, median "
          f"of {args.passes} epochs); the suite needs at least {REQUIRED_RATIO} x 01's samples/s", flush=True)
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
