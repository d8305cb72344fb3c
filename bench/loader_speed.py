"""How fast the scripts' own input pipeline is, alone, next to how fast 01 trains.

    python bench/loader_speed.py --synthetic                      # random data, the GPU when there is one
    python bench/loader_speed.py --data-dir data --cpu            # real MNIST, on the CPU
    python bench/loader_speed.py --synthetic --json loader.json   # also write the figures as JSON

It imports 01_single_gpu.py and builds the training loader exactly as its run() does (load_mnist,
DistributedSampler with one replica and set_epoch, loader()), then iterates whole epochs copying every batch
to the device with non_blocking=True and nothing else: the first batches are left out (warm-up), the device
is synchronised before each clock read, and the median over --passes epochs counts. In the same process it
times --train-steps steps of 01's own train_epoch() on that loader (01's samples_per_s rule). The suite
claims that the input pipeline is never what it measures; that holds when the loader alone is at least
REQUIRED_RATIO (50) times faster than training.

bench/run_all.py runs it once per sweep with --train-steps 0 (loader only) and compares with the sweep's
own 01 figure in report.md (sweep_figure below).
"""
import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sibling modules, from any working directory

from files import read_json, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED_RATIO = 50  # loader samples/s over training samples/s
SWEEP_TIMEOUT_S = 300


def load_script(name="01_single_gpu.py"):
    """A numbered script as a module (its name starts with a digit, so `import` cannot load it)."""
    spec = importlib.util.spec_from_file_location(f"script_{name[:2]}", os.path.join(REPO, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data", help="torchvision's MNIST folder (as 01's --data-dir)")
    p.add_argument("--synthetic", action="store_true", help="random MNIST-shaped data (as 01's --synthetic)")
    p.add_argument("--cpu", action="store_true", help="ignore GPUs")
    p.add_argument("--batch-size", type=int, default=64, help="01's --batch-size (default 64)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: as 01, every core)")
    p.add_argument("--passes", type=int, default=5, help="timed epochs of the loader; the median counts (default 5)")
    p.add_argument("--train-steps", type=int, default=30,
                   help="training steps timed with 01's train_epoch, its 5 warm-up steps included; 0: loader only")
    p.add_argument("--json", metavar="PATH", help="write the figures here")
    args = p.parse_args(argv)
    for name in ("batch_size", "passes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.train_steps < 0 or args.threads < 0:
        p.error("--train-steps and --threads must be zero or positive")
    return args


def script_args(m01, args):
    """01's own argument namespace, so that load_mnist, setup and train_epoch see what a run of 01 sees."""
    argv = ["--batch-size", str(args.batch_size), "--threads", str(args.threads), "--log-interval", "0",
            "--max-steps", str(args.train_steps), "--data-dir", args.data_dir]
    return m01.parse_args(argv + ["--synthetic"] * args.synthetic + ["--cpu"] * args.cpu)


def train_loader(m01, a, train_set, device, epoch):
    """The training loader exactly as 01's run() builds it (same sampler, same seed, set_epoch)."""
    sampler = m01.DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=a.seed)
    sampler.set_epoch(epoch)
    return m01.loader(train_set, sampler, a.batch_size, device)


def loader_pass(m01, batches, device, warmup):
    """Samples/s of one epoch: fetch each batch and copy it to the device, nothing else."""
    samples, t0 = 0, None
    for i, (data, target) in enumerate(batches):
        if i == warmup:
            m01.synchronize(device)  # copies are asynchronous on CUDA: read the clock once they are done
            t0 = time.perf_counter()
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        samples += len(target) if i >= warmup else 0
    m01.synchronize(device)
    return samples / (time.perf_counter() - t0)


def train_speed(m01, a, ctx, train_set):
    """Samples/s of --train-steps steps of 01's train_epoch, by its own rule (warm-up left out, synchronised)."""
    import torch
    device = ctx["device"]
    torch.manual_seed(a.seed)
    model = m01.Net(dropout=not a.no_dropout).to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=a.lr)
    sums, clocks = m01.train_epoch(model, train_loader(m01, a, train_set, device, 1), optimizer, device, a, ctx, 1)
    return sums[2].item() / clocks[1].item()


def measure(args):
    m01 = load_script()
    a = script_args(m01, args)
    ctx = m01.setup(a)  # device and thread count chosen by 01's own rule
    device, t_load = ctx["device"], time.perf_counter()
    train_set = m01.to_device(m01.load_mnist(a, train=True), device)
    load_s = time.perf_counter() - t_load
    warmup = min(m01.WARMUP_STEPS, len(train_set) // a.batch_size - 1)  # the same warm-up as 01's training
    speeds = [loader_pass(m01, train_loader(m01, a, train_set, device, epoch), device, warmup)
              for epoch in range(1, args.passes + 1)]
    loader_speed = statistics.median(speeds)
    training = train_speed(m01, a, ctx, train_set) if args.train_steps else None
    return dict(
        loader_samples_per_s=loader_speed, loader_passes_samples_per_s=speeds, train_samples_per_s=training,
        ratio=loader_speed / training if training else None, required_ratio=REQUIRED_RATIO,
        meets_requirement=loader_speed / training >= REQUIRED_RATIO if training else None,
        load_mnist_s=load_s, device=str(device), threads=ctx["threads"], batch_size=a.batch_size,
        train_samples=len(train_set), warmup_batches=warmup, train_steps=args.train_steps,
        synthetic=a.synthetic, data_dir=None if a.synthetic else a.data_dir, argv=sys.argv)


def summary_line(r):
    line = f"loader alone: {r['loader_samples_per_s']:,.0f} samples/s on {r['device']} (batch {r['batch_size']}, " \
           f"median of {len(r['loader_passes_samples_per_s'])} epochs)"
    if r["train_samples_per_s"]:
        verdict = "met" if r["meets_requirement"] else "NOT met"
        line += f" = {r['ratio']:,.0f} x 01's training throughput ({r['train_samples_per_s']:,.0f} samples/s); " \
                f"requirement >= {REQUIRED_RATIO}x: {verdict}"
    return line


def sweep_figure(settings, repo, out_dir):
    """For bench/run_all.py: the loader figure of this sweep's data, batch and first device, or {'error': ...}.

    It runs as its own process (as a user would start it) so that the harness never initialises CUDA, and
    with --train-steps 0: the report divides by the 01 throughput the sweep itself measures.
    """
    path = os.path.join(out_dir, "loader_speed.json")
    argv = [sys.executable, os.path.join(repo, "bench", "loader_speed.py"), "--batch-size",
            str(settings.per_gpu_batch), "--train-steps", "0", "--passes", "3", "--json", path]
    argv += ["--synthetic"] if settings.synthetic else ["--data-dir", settings.data_dir]
    argv += ["--cpu"] if settings.cpu else []
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=",".join(settings.devices[:1]))
    try:
        out = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S)
        if out.returncode != 0:
            return {"error": (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]}
        return read_json(path) or {"error": f"no result in {path}"}
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def check_json_path(path):
    """Fail before measuring, not after minutes of it (the three bench tools share this)."""
    folder = os.path.dirname(os.path.abspath(path or "."))
    if path and (os.path.isdir(path) or not os.access(folder, os.W_OK)):
        sys.exit(f"error: cannot write {path}: {folder} does not exist or is not writable")


def main(argv=None):
    args = parse_args(argv)
    check_json_path(args.json)
    result = measure(args)
    print(summary_line(result), flush=True)
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
