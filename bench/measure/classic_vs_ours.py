"""01's whole run, end to end, against a classic pytorch/examples-style MNIST trainer, alternately, on the CPU.

    python -m bench.measure.classic_vs_ours --make-fake /tmp/fake-mnist --json classic_vs_ours.json
    python -m bench.measure.classic_vs_ours --data-dir data --max-steps 50    # a quick look

Each run is a fresh process timed from start to exit, in the order ours, classic, ours, ... (--repeats
pairs), so that a machine that slows down weighs on both alike. The classic trainer (train_classic) is
pytorch/examples/mnist/main.py's pipeline: torchvision's MNIST decoded into PIL images and normalised on
every fetch by ToTensor() and Normalize(), a default DataLoader with shuffle=True and num_workers=0 (as
pytorch/examples on the CPU: a worker would take cores from training), the same model, optimizer, batches
and threads. The aim: ours / classic <= 0.8, each the best of its runs (other work only adds time).
--make-fake DIR first writes a learnable stand-in of MNIST's full size there (offline machines).
"""
import argparse
import os
import shlex
import subprocess
import sys
import time

from bench.fake_mnist import missing_mnist_files, write_fake_mnist
from bench.files import json_path, write_json
from bench.machine import cpu_cores, environment
from bench.scripts import REPO, load_script

REQUIRED_RATIO = 0.8  # ours / classic, wall time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", help="torchvision's MNIST folder (MNIST/raw/ inside)")
    p.add_argument("--make-fake", metavar="DIR", help="write a full-size learnable fake MNIST in DIR and use it")
    p.add_argument("--fake-train", type=int, default=60000, help="training images of --make-fake (default 60,000)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each trainer, alternating (default 2)")
    p.add_argument("--max-steps", type=int, default=0, help="training steps per run (0: the whole epoch)")
    p.add_argument("--threads", type=int, default=cpu_cores(), help="CPU threads of both trainers (default: all)")
    p.add_argument("--json", type=json_path, metavar="PATH", help="write every run and the ratio here, env.json beside")
    p.add_argument("--classic", action="store_true", help=argparse.SUPPRESS)  # the timed child: train_classic
    args = p.parse_args(argv)
    if not (args.data_dir or args.make_fake):
        p.error("give --data-dir (MNIST/raw/ inside) or --make-fake DIR")
    args.data_dir = os.path.abspath(args.make_fake or args.data_dir)  # the runs start in the repository root
    return args


def train_classic(data_dir, threads, max_steps):
    """pytorch/examples/mnist/main.py's pipeline for one epoch, then its test(); prints the accuracy."""
    import torch
    import torch.nn.functional as F
    from torchvision import datasets, transforms
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train_set = datasets.MNIST(data_dir, train=True, download=False, transform=transform)
    test_set = datasets.MNIST(data_dir, train=False, download=False, transform=transform)
    model = load_script().Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    model.train()
    for step, (data, target) in enumerate(torch.utils.data.DataLoader(train_set, batch_size=64, shuffle=True)):
        if max_steps and step >= max_steps:
            break
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in torch.utils.data.DataLoader(test_set, batch_size=1000):
            output = model(data)
            test_loss += F.cross_entropy(output, target, reduction="sum").item()
            correct += (output.argmax(dim=1) == target).sum().item()
    print(f"classic: test loss {test_loss / len(test_set):.4f}, accuracy {correct / len(test_set):.2%} "
          f"of {len(test_set)} images")


def timed_run(argv):
    """Wall seconds of one run, from process start to exit, and what it said; a failed run stops everything."""
    t0 = time.perf_counter()
    out = subprocess.run(argv, cwd=REPO, env=dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1"),
                         capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        sys.exit(f"error: {shlex.join(argv)} exited {out.returncode}: {out.stderr.strip()[-500:]}")
    return wall, "; ".join(line for line in out.stdout.splitlines() if "accuracy" in line or "samples/s" in line)


def compare(args):
    common = ["--data-dir", args.data_dir, "--threads", str(args.threads)]
    common += ["--max-steps", str(args.max_steps)] if args.max_steps else []
    trainers = [("ours", [sys.executable, "01_single_gpu.py", "--epochs", "1", "--log-interval", "0", "--cpu"]),
                ("classic", [sys.executable, "-m", "bench.measure.classic_vs_ours", "--classic"])]
    runs = []
    for repeat in range(1, args.repeats + 1):
        for name, argv in trainers:
            wall, said = timed_run(argv + common)
            runs.append(dict(trainer=name, repeat=repeat, wall_s=wall, command=shlex.join(argv + common), output=said))
            print(f"{name:7s} run {repeat}: {wall:6.1f} s   ({said})", flush=True)
    best = {name: min(r["wall_s"] for r in runs if r["trainer"] == name) for name, _ in trainers}
    return dict(runs=runs, ours_best_s=best["ours"], classic_best_s=best["classic"],
                ratio=best["ours"] / best["classic"], required_ratio=REQUIRED_RATIO, threads=args.threads,
                max_steps=args.max_steps, repeats=args.repeats, data_dir=args.data_dir, argv=sys.argv)


def main(argv=None):
    args = parse_args(argv)
    if args.classic:
        return train_classic(args.data_dir, args.threads, args.max_steps)
    if args.make_fake:
        print(f"writing a fake MNIST ({args.fake_train:,} + 10,000 images) in {args.make_fake}", flush=True)
        write_fake_mnist(args.make_fake, train=args.fake_train)
    if missing_mnist_files(args.data_dir):
        sys.exit(f"error: {', '.join(missing_mnist_files(args.data_dir))} not in {args.data_dir}/MNIST/raw")
    r = compare(args)
    print(f"ours/classic = {r['ours_best_s']:.1f} s / {r['classic_best_s']:.1f} s = {r['ratio']:.2f} (best of "
          f"{args.repeats} each, {args.threads} threads; aim <= {REQUIRED_RATIO}: "
          f"{'met' if r['ratio'] <= REQUIRED_RATIO else 'NOT met'})")
    if args.json:
        write_json(args.json, r)
        write_json(os.path.join(os.path.dirname(os.path.abspath(args.json)), "env.json"), environment(REPO, []))


if __name__ == "__main__":
    main()
