"""MNIST with nn.DataParallel: one process splits each batch over several GPUs.

    python 02_data_parallel.py                            # all visible GPUs, batch 64 in total
    python 02_data_parallel.py --gpus 0,1 --batch-size 128   # 2 GPUs, 64 images each
    CUDA_VISIBLE_DEVICES=2,3 python 02_data_parallel.py   # choose the GPUs

--batch-size is the loader's batch, split across the GPUs: give n x the per-GPU batch to compare with DDP.
On a machine without CUDA there is nothing to parallelise: it says so and runs as a single replica.
"""
import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset
from torchvision import datasets

MODE = "dp"
WARMUP_STEPS = 5  # left out of samples_per_s: first steps pay for allocation and kernel selection
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


class Net(nn.Module):
    """The classic PyTorch MNIST CNN (about 1.2 M parameters)."""

    def __init__(self, dropout=True):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout(0.5 if dropout else 0.0)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.relu(self.fc1(torch.flatten(self.dropout1(x), 1)))
        return self.fc2(self.dropout2(x))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data", help="where torchvision's MNIST lives (downloaded if missing)")
    p.add_argument("--synthetic", action="store_true", help="random MNIST-shaped data: for throughput only")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64, help="batch of this process's loader")
    p.add_argument("--test-batch-size", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1.0, help="Adadelta learning rate, decayed by 0.7 each epoch")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0, help="train at most this many steps per epoch (0: all)")
    p.add_argument("--log-interval", type=int, default=100, help="steps between progress lines (0: none)")
    p.add_argument("--cpu", action="store_true", help="ignore GPUs")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per process (default: cores / processes)")
    p.add_argument("--no-dropout", action="store_true", help="disable dropout (for exact comparisons between modes)")
    p.add_argument("--amp", action="store_true", help="train in bfloat16 autocast (evaluation stays in float32)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--save-model", metavar="PATH", help="save the trained weights (state_dict) here")
    p.add_argument("--metrics-json", metavar="PATH", help="write the run's metrics record here")
    p.add_argument("--gpus", help="comma-separated GPU ids to use (default: all visible)")
    return p.parse_args(argv)


def fail(message):
    """Bad input ends the run with one line on stderr, never a traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_args(args):
    for name in ("epochs", "batch_size", "test_batch_size"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if min(args.max_steps, args.log_interval, args.threads) < 0:
        fail("--max-steps, --log-interval and --threads must not be negative")
    for path in (args.metrics_json, args.save_model):
        if path and (os.path.isdir(path) or not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK)):
            fail(f"cannot write {path}: its folder does not exist or is not writable")


def parse_gpus(args, cuda):
    if args.gpus is None:
        return list(range(torch.cuda.device_count())) if cuda else []
    try:
        gpus = [int(i) for i in args.gpus.split(",")]
    except ValueError:
        fail(f"--gpus {args.gpus!r} is not a comma-separated list of GPU ids")
    visible = torch.cuda.device_count() if cuda else 0
    if visible == 0:
        fail(f"--gpus {args.gpus}: no CUDA GPU is visible here (leave out --gpus to run on the CPU)")
    if not gpus or len(set(gpus)) < len(gpus) or not all(0 <= i < visible for i in gpus):
        fail(f"--gpus {args.gpus}: {visible} GPU(s) visible, ids must be distinct and in 0..{visible - 1}")
    return gpus


def setup(args):
    """The one place that decides the devices: DataParallel keeps the model and the batch on the first GPU."""
    cuda = torch.cuda.is_available() and not args.cpu
    gpus = parse_gpus(args, cuda)
    if not cuda:
        print("DataParallel has nothing to parallelise on the CPU: running as a single replica", file=sys.stderr)
    device = torch.device("cuda", gpus[0]) if cuda else torch.device("cpu")
    threads = args.threads or len(os.sched_getaffinity(0))  # one process: all the cores it may use
    torch.set_num_threads(threads)
    return dict(rank=0, local_rank=0, world_size=max(len(gpus), 1), nodes=1, device=device, threads=threads,
                master=True, backend=None, gpus=gpus)


def load_mnist(args, train):
    """The split as one normalised tensor pair, so the input pipeline is never what we measure."""
    if args.synthetic:
        g = torch.Generator().manual_seed(args.seed + train)
        n = 60000 if train else 10000
        return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))
    try:
        ds = datasets.MNIST(args.data_dir, train=train, download=True)
    except Exception as e:
        raw = os.path.join(args.data_dir, "MNIST", "raw")
        fail(f"MNIST could not be loaded from {raw} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
             "it needs train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
             "t10k-labels-idx1-ubyte there (delete a corrupt one to download it again), or use --synthetic")
    images = ds.data.unsqueeze(1).float().div_(255).sub_(MNIST_MEAN).div_(MNIST_STD)
    return TensorDataset(images, ds.targets)


def to_device(dataset, device):
    """MNIST (220 MB as float32) fits on any GPU: there, each batch is one indexing operation on the device
    instead of a copy from the host, so the loader stays far ahead of training (bench/loader_speed.py)."""
    return TensorDataset(*(t.to(device) for t in dataset.tensors)) if device.type == "cuda" else dataset


def loader(dataset, sampler, batch_size, device):
    # The sampler's indices are fetched a whole batch at a time. Data left on the host is pinned, so that the
    # non-blocking copies to the GPU are truly asynchronous. Its own generator: starting an epoch must not
    # draw from the global RNG that dropout uses.
    pin = device.type == "cuda" and dataset.tensors[0].device.type == "cpu"
    return DataLoader(dataset, sampler=BatchSampler(sampler, batch_size, drop_last=False), batch_size=None,
                      pin_memory=pin, generator=torch.Generator())


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_epoch(model, train_loader, optimizer, device, args, ctx, epoch):
    """One epoch. Returns this process's sums (loss, samples, steady samples), clocks (epoch s, steady s, steps)."""
    model.train()
    loss_sum, samples, steady_samples, steps = torch.zeros((), dtype=torch.float64, device=device), 0, 0, 0
    steps_planned = min(len(train_loader), args.max_steps or len(train_loader))
    warmup = min(WARMUP_STEPS, steps_planned - 1) if epoch == 1 else 0  # at least one step is timed
    synchronize(device)
    t_start = t_steady = time.perf_counter()
    for step, (data, target) in zip(range(steps_planned), train_loader):
        if step == warmup:
            synchronize(device)  # GPU work is asynchronous: read the clock only once it is done
            t_steady = time.perf_counter()
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach() * len(target)  # stays on the device: no synchronisation per step
        samples, steps = samples + len(target), steps + 1
        steady_samples += len(target) if step >= warmup else 0
        if ctx["master"] and args.log_interval and step % args.log_interval == 0:
            print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
    synchronize(device)
    t_end = time.perf_counter()
    counts = torch.tensor([samples, steady_samples], dtype=torch.float64, device=device)
    return torch.cat([loss_sum.view(1), counts]), torch.tensor(
        [t_end - t_start, t_end - t_steady, steps], dtype=torch.float64, device=device)


@torch.no_grad()
def evaluate(model, test_loader, device):
    """Sums over this process's test images: (loss, correct, count)."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for data, target in test_loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        output = model(data)
        totals[0] += F.cross_entropy(output, target, reduction="sum")
        totals[1] += (output.argmax(dim=1) == target).sum()
        totals[2] += len(target)
    return totals


def peak_memory_bytes(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak resident memory, KiB on Linux


def write_json_atomically(path, record):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
    os.replace(tmp, path)  # a reader never sees half a file, and a crash never leaves one


def metrics_record(args, ctx, epochs, totals):
    device = ctx["device"]
    samples, steady_samples, steady_s, steps, peak_memory = totals
    return dict(
        schema=1, script=os.path.basename(__file__), mode=MODE, device_type=device.type,
        device_names=[torch.cuda.get_device_name(i) for i in ctx["gpus"]] or ["cpu"],
        world_size=ctx["world_size"], nodes=ctx["nodes"], backend=ctx["backend"], threads=ctx["threads"],
        per_device_batch=args.batch_size / ctx["world_size"], global_batch=args.batch_size, lr=args.lr,
        epochs=args.epochs, steps=int(steps), train_samples=int(samples),
        samples_per_s=steady_samples / steady_s if steady_s > 0 else None, steady_samples=int(steady_samples),
        steady_time_s=steady_s, epochs_detail=epochs,
        test_accuracy=epochs[-1]["test_accuracy"], test_loss=epochs[-1]["test_loss"],
        peak_memory_bytes=int(peak_memory), synthetic=args.synthetic, amp=args.amp, compile=args.compile,
        torch_version=torch.__version__, argv=sys.argv)


def run(args, ctx):
    device = ctx["device"]
    torch.manual_seed(args.seed)
    train_set, test_set = load_mnist(args, train=True), load_mnist(args, train=False)
    train_set, test_set = to_device(train_set, device), to_device(test_set, device)
    # The same shuffle as the DDP scripts (one replica here), so every mode sees the same data order.
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed)
    train_loader = loader(train_set, sampler, args.batch_size, device)
    test_loader = loader(test_set, range(len(test_set)), args.test_batch_size, device)

    net = Net(dropout=not args.no_dropout).to(device)
    # Every step scatters the batch from the first GPU, replicates the model, and gathers the outputs back.
    model = nn.DataParallel(net, device_ids=ctx["gpus"], output_device=device) if ctx["gpus"] else net
    model = torch.compile(model) if args.compile else model
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)

    epochs, totals = [], torch.zeros(4, dtype=torch.float64)
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        sums, clocks = train_epoch(model, train_loader, optimizer, device, args, ctx, epoch)
        scheduler.step()
        test_loss, correct, count = evaluate(model, test_loader, device).tolist()
        (loss_sum, samples, steady_samples), (epoch_s, steady_s, steps) = sums.tolist(), clocks.tolist()
        totals += torch.tensor([samples, steady_samples, steady_s, steps], dtype=torch.float64)
        epochs.append(dict(epoch=epoch, train_time_s=epoch_s, train_loss=loss_sum / samples,
                           test_loss=test_loss / count, test_accuracy=correct / count, test_samples=int(count)))
        if ctx["master"]:
            print(f"epoch {epoch}: train loss {loss_sum / samples:.4f}, test loss {test_loss / count:.4f}, "
                  f"accuracy {correct / count:.2%} of {int(count)} images, {epoch_s:.1f} s", flush=True)

    # The first GPU's: it holds the model's master copy and the gathered outputs, so it is the fullest.
    peak_memory = torch.tensor(peak_memory_bytes(device), dtype=torch.float64)
    record = metrics_record(args, ctx, epochs, totals.tolist() + [peak_memory.item()])
    if ctx["master"]:
        print(f"{MODE}: {record['samples_per_s'] or 0:.0f} samples/s, world size {ctx['world_size']}, {device}"
              + (" (synthetic data: accuracy is meaningless)" if args.synthetic else ""))
        if args.save_model:
            torch.save(net.state_dict(), args.save_model)
        if args.metrics_json:
            write_json_atomically(args.metrics_json, record)


def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    run(args, setup(args))


if __name__ == "__main__":
    main()
