"""01's whole run, end to end, against a classic pytorch/examples-style MNIST trainer, alternately, on the CPU.

    python bench/classic_vs_ours.py --make-fake /tmp/fake-mnist --json results/cpu-pipeline/classic_vs_ours.json
    python bench/classic_vs_ours.py --data-dir data                   # real MNIST already in ./data
    python bench/classic_vs_ours.py --data-dir data --max-steps 50    # a quick look, not the closing figure

Each run is a fresh process timed from start to exit (start-up, loading, one epoch of training, evaluation
of the 10,000 test images), in the order ours, classic, ours, classic, ... (--repeats pairs), so that a
machine that slows down or speeds up during the comparison weighs on both alike:
    ours     python 01_single_gpu.py --epochs 1 --data-dir D --log-interval 0 --cpu --threads T
    classic  python bench/classic_vs_ours.py --classic --data-dir D --threads T   (train_classic below)
The classic trainer is the pipeline of pytorch/examples/mnist/main.py, kept here and not in the numbered
scripts: torchvision's MNIST with transforms.Compose([ToTensor(), Normalize((0.1307,), (0.3081,))]), so
every image is decoded into a PIL image and normalised on every fetch, and a default DataLoader with
shuffle=True. Same model (01's Net), Adadelta lr 1.0 with StepLR 0.7, batch 64, test batch 1000, same
thread count. Its loaders use num_workers=0, as pytorch/examples does on the CPU (it asks for one worker
only with CUDA): on a CPU machine a worker process would take cores from the training threads, which both
trainers are given equally. The requirement: ours / classic <= 0.8, each the best (fastest) of its runs,
since other work on the machine only ever adds time; the medians are in the JSON too.

Real MNIST cannot be fetched on an offline machine: --make-fake DIR first writes a learnable stand-in of
MNIST's full size (60,000 + 10,000 images) in torchvision's raw layout there (write_fake_mnist). The --json
file gets env.json (bench/envinfo.py) written beside it.
"""
import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling modules, from any working directory

import envinfo  # noqa: E402
from fake_mnist import MNIST_FILES, missing_mnist_files, write_fake_mnist  # noqa: E402
from files import write_json  # noqa: E402
from loader_speed import REPO, check_json_path, load_script  # noqa: E402

REQUIRED_RATIO = 0.8  # ours / classic, wall time
RUN_TIMEOUT_S = 1800


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", help="torchvision's MNIST folder (MNIST/raw/ inside); with --make-fake, that folder")
    p.add_argument("--make-fake", metavar="DIR", help="write a full-size learnable fake MNIST in DIR and use it")
    p.add_argument("--fake-train", type=int, default=60000, help="training images of --make-fake (default 60,000)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each trainer, alternating (default 2)")
    p.add_argument("--max-steps", type=int, default=0, help="training steps per run (0: the whole epoch)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads of both trainers (default: every core)")
    p.add_argument("--json", metavar="PATH", help="write every run's time and the ratio here (env.json beside it)")
    p.add_argument("--classic", action="store_true", help=argparse.SUPPRESS)  # the timed child: train_classic
    args = p.parse_args(argv)
    if not (args.data_dir or args.make_fake):
        p.error("give --data-dir (MNIST/raw/ inside) or --make-fake DIR")
    if args.repeats < 1 or args.fake_train < 1 or args.max_steps < 0 or args.threads < 0:
        p.error("--repeats and --fake-train must be positive, --max-steps and --threads zero or positive")
    args.data_dir = os.path.abspath(args.make_fake or args.data_dir)  # the runs start in the repository root
    args.threads = args.threads or envinfo.cpu_cores()
    return args


# ---- the classic trainer (runs in the timed child process)

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
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=64, shuffle=True, num_workers=0)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=1000, num_workers=0)
    model = load_script().Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    model.train()
    for step, (data, target) in enumerate(train_loader):
        if max_steps and step >= max_steps:
            break
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
    scheduler.step()
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.cross_entropy(output, target, reduction="sum").item()
            correct += (output.argmax(dim=1) == target).sum().item()
    print(f"classic: test loss {test_loss / len(test_set):.4f}, accuracy {correct / len(test_set):.2%} "
          f"of {len(test_set)} images")


# ---- the comparison

def commands(args):
    """(name, argv) of both trainers, as a user would start them from the repository root."""
    common = ["--data-dir", args.data_dir, "--threads", str(args.threads)]
    common += ["--max-steps", str(args.max_steps)] if args.max_steps else []
    ours = [sys.executable, "01_single_gpu.py", "--epochs", "1", "--log-interval", "0", "--cpu"] + common
    classic = [sys.executable, "bench/classic_vs_ours.py", "--classic"] + common
    return [("ours", ours), ("classic", classic)]


def check_data(data_dir):
    raw = os.path.join(data_dir, "MNIST", "raw")
    missing = missing_mnist_files(data_dir)
    if missing:
        sys.exit(f"error: {', '.join(missing)} not in {raw}: put MNIST there or use --make-fake DIR")
    for f in MNIST_FILES:  # read once, untimed, so that the first timed run does not pay for a cold disk cache
        with open(os.path.join(raw, f), "rb") as fh:
            while fh.read(1 << 24):
                pass


def timed_run(argv):
    """Wall seconds of one run, from process start to exit; a failed run stops the comparison."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")  # the CPU only, for both alike
    t0 = time.perf_counter()
    out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        sys.exit(f"error: {shlex.join(argv)} exited {out.returncode}: {out.stderr.strip()[-500:]}")
    said = [line for line in out.stdout.splitlines() if "accuracy" in line or "samples/s" in line]
    return wall, "; ".join(said)  # its accuracy: proof that it trained and evaluated


def compare(args):
    runs = []
    for repeat in range(1, args.repeats + 1):
        for name, argv in commands(args):
            wall, said = timed_run(argv)
            runs.append(dict(trainer=name, repeat=repeat, wall_s=wall, command=shlex.join(argv), output=said))
            print(f"{name:7s} run {repeat}: {wall:6.1f} s   ({said})", flush=True)
    walls = {name: [r["wall_s"] for r in runs if r["trainer"] == name] for name in ("ours", "classic")}
    # Best of K: other work on the machine only ever adds time, so the fastest run of each is the least noisy.
    ratio = min(walls["ours"]) / min(walls["classic"])
    return dict(runs=runs, ours_best_s=min(walls["ours"]), classic_best_s=min(walls["classic"]), ratio=ratio,
                ours_median_s=statistics.median(walls["ours"]), classic_median_s=statistics.median(walls["classic"]),
                required_ratio=REQUIRED_RATIO, meets_requirement=ratio <= REQUIRED_RATIO, threads=args.threads,
                classic_num_workers=0, max_steps=args.max_steps, repeats=args.repeats, data_dir=args.data_dir,
                fake_train_images=args.fake_train if args.make_fake else None, argv=sys.argv)


def main(argv=None):
    args = parse_args(argv)
    if args.classic:
        return train_classic(args.data_dir, args.threads, args.max_steps)
    check_json_path(args.json)
    if args.make_fake:
        print(f"writing a fake MNIST ({args.fake_train:,} + 10,000 images) in {args.make_fake}", flush=True)
        write_fake_mnist(args.make_fake, train=args.fake_train)
    check_data(args.data_dir)
    result = compare(args)
    verdict = "met" if result["meets_requirement"] else "NOT met"
    print(f"ours/classic = {result['ours_best_s']:.1f} s / {result['classic_best_s']:.1f} s = {result['ratio']:.2f} "
          f"(best of {args.repeats} each, {args.threads} threads; requirement <= {REQUIRED_RATIO}: {verdict})")
    if args.json:
        write_json(args.json, result)
        write_json(os.path.join(os.path.dirname(os.path.abspath(args.json)), "env.json"), envinfo.collect(REPO, []))


if __name__ == "__main__":
    main()
