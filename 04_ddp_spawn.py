"""MNIST with DistributedDataParallel, the processes started by the script itself (torch.multiprocessing.spawn).

    python 04_ddp_spawn.py --nprocs 2                    # 2 processes: 2 GPUs, or 2 shares of the CPU
    python 04_ddp_spawn.py --nprocs 2 --synthetic --max-steps 100
    CUDA_VISIBLE_DEVICES=0,1 python 04_ddp_spawn.py      # default: one process per visible GPU

The port is a free one unless --master-port or MASTER_PORT says otherwise, so several jobs can share a host.
"""
import argparse
import json
import os
import resource
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.nn as nn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset
from torchvision import datasets

MODE = "ddp_spawn"
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
    p.add_argument("--timeout", type=float, default=300, help="seconds a process waits for its peers before failing")
    p.add_argument("--snapshot", metavar="PATH", help="save training state here each epoch; resume from it if it exists")
    p.add_argument("--snapshot-every", type=int, default=0, metavar="N", help="also save every N steps")
    p.add_argument("--nprocs", type=int, default=torch.cuda.device_count() or 2,
                   help="processes to start (default: one per visible GPU, or 2 on the CPU)")
    p.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT", 0)),
                   help="port of the rendezvous on this host (default: a free one)")
    return p.parse_args(argv)


def fail(message):
    """Bad input ends the run with one line on stderr, never a traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_args(args):
    for name in ("epochs", "batch_size", "test_batch_size"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if min(args.max_steps, args.log_interval, args.threads, args.snapshot_every) < 0 or args.timeout <= 0:
        fail("--max-steps, --log-interval, --threads and --snapshot-every must not be negative, --timeout positive")
    if args.nprocs <= 0:
        fail(f"--nprocs must be positive, got {args.nprocs}")
    if torch.cuda.is_available() and not args.cpu and args.nprocs > torch.cuda.device_count():
        fail(f"--nprocs {args.nprocs}: only {torch.cuda.device_count()} GPU(s) are visible, one per process")
    if not 0 <= args.master_port <= 65535:
        fail(f"--master-port {args.master_port} is not a port number (1..65535, or 0 for a free one)")
    for path in (args.metrics_json, args.save_model, args.snapshot):
        if path and (os.path.isdir(path) or not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK)):
            fail(f"cannot write {path}: its folder does not exist or is not writable")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup(args, local_rank):
    """The one place that decides rank, world size and device, and joins the process group."""
    rank, world_size = local_rank, args.nprocs  # one host: the local rank is the global rank
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda and local_rank >= torch.cuda.device_count():
        fail(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} are visible")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # Processes on one host share its cores; the same rule in every script keeps the comparison fair.
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // args.nprocs)
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=args.timeout), device_id=device if cuda else None)
    except dist.DistError as e:
        fail(f"rank {rank} could not join the process group at {os.environ.get('MASTER_ADDR')}:"
             f"{os.environ.get('MASTER_PORT')}: {str(e).splitlines()[0]}")
    return dict(rank=rank, local_rank=local_rank, world_size=world_size, device=device, threads=threads,
                nodes=1, master=rank == 0,
                backend=dist.get_backend())


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


def train_epoch(model, train_loader, optimizer, device, args, ctx, epoch, start_step=0, snapshot=None):
    """One epoch from start_step, saving a snapshot every --snapshot-every steps.
    Returns this process's sums (loss, samples, steady samples), clocks (epoch s, steady s, steps)."""
    model.train()
    loss_sum, samples, steady_samples, steps = torch.zeros((), dtype=torch.float64, device=device), 0, 0, 0
    steps_planned = min(len(train_loader), args.max_steps or len(train_loader))
    warmup = min(start_step + WARMUP_STEPS, steps_planned - 1) if epoch == 1 or start_step else 0
    synchronize(device)
    t_start = t_steady = time.perf_counter()
    for step, (data, target) in zip(range(steps_planned), train_loader):
        if step < start_step:
            continue  # trained before a restart: the sampler repeats the epoch's order, so skip to where we were
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
        if snapshot and args.snapshot_every and (step + 1) % args.snapshot_every == 0:
            snapshot(epoch, step + 1)
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


def rng_states(device):
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])


def save_snapshot(path, ctx, net, optimizer, scheduler, epoch, step):
    """All that continuing exactly needs: weights, optimizer, schedule, position, and every rank's RNG (dropout)."""
    rngs = [None] * ctx["world_size"]
    dist.all_gather_object(rngs, rng_states(ctx["device"]))
    if ctx["master"]:
        state = dict(model=net.state_dict(), optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
                     epoch=epoch, step=step, rngs=rngs)
        torch.save(state, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)  # a kill during the save leaves the previous snapshot whole


def resume(path, ctx, net, optimizer, scheduler):
    """(epoch, step) to continue from: the snapshot's, loaded on every rank onto its own device, or (1, 0)."""
    if not (path and os.path.exists(path)):
        return 1, 0
    try:
        state = torch.load(path, map_location=ctx["device"])
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    except Exception as e:
        fail(f"snapshot {path} could not be loaded ({str(e).splitlines()[0]}); move it away to start afresh")
    if len(state["rngs"]) != ctx["world_size"]:
        fail(f"snapshot {path} is from a job of {len(state['rngs'])} processes, this one has {ctx['world_size']}; "
             "move it away to start afresh")
    torch.set_rng_state(state["rngs"][ctx["rank"]][0].cpu())
    if ctx["device"].type == "cuda":
        torch.cuda.set_rng_state(state["rngs"][ctx["rank"]][1].cpu(), ctx["device"])
    if ctx["master"]:
        print(f"resuming from {path}: epoch {state['epoch']}, step {state['step']}", flush=True)
    return state["epoch"], state["step"]


def metrics_record(args, ctx, epochs, totals):
    device = ctx["device"]
    samples, steady_samples, steady_s, steps, peak_memory = totals
    return dict(
        schema=1, script=os.path.basename(__file__), mode=MODE, device_type=device.type,
        device_names=[torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"],
        world_size=ctx["world_size"], nodes=ctx["nodes"], backend=ctx["backend"], threads=ctx["threads"],
        per_device_batch=args.batch_size, global_batch=args.batch_size * ctx["world_size"], lr=args.lr,
        epochs=args.epochs, steps=int(steps), train_samples=int(samples),
        samples_per_s=steady_samples / steady_s if steady_s > 0 else None, steady_samples=int(steady_samples),
        steady_time_s=steady_s, epochs_detail=epochs,
        test_accuracy=epochs[-1]["test_accuracy"], test_loss=epochs[-1]["test_loss"],
        peak_memory_bytes=int(peak_memory), synthetic=args.synthetic, amp=args.amp, compile=args.compile,
        torch_version=torch.__version__, argv=sys.argv)


def run(args, ctx):
    device = ctx["device"]
    torch.manual_seed(args.seed)
    if ctx["local_rank"] != 0:
        dist.barrier()  # one process per node downloads; the others wait, then read its files
    train_set, test_set = load_mnist(args, train=True), load_mnist(args, train=False)
    if ctx["local_rank"] == 0:
        dist.barrier()
    train_set, test_set = to_device(train_set, device), to_device(test_set, device)
    # Each rank trains on its own 1/world_size of every shuffled epoch.
    sampler = DistributedSampler(train_set, ctx["world_size"], ctx["rank"], shuffle=True, seed=args.seed)
    train_loader = loader(train_set, sampler, args.batch_size, device)
    # Each rank evaluates every world_size-th test image: all 10,000 exactly once, no padded duplicates.
    test_shard = range(ctx["rank"], len(test_set), ctx["world_size"])
    test_loader = loader(test_set, test_shard, args.test_batch_size, device)

    net = Net(dropout=not args.no_dropout).to(device)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    model = torch.compile(model) if args.compile else model
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    first_epoch, start_step = resume(args.snapshot, ctx, net, optimizer, scheduler)
    snapshot = args.snapshot and (lambda *at: save_snapshot(args.snapshot, ctx, net, optimizer, scheduler, *at))
    if first_epoch > args.epochs:
        print(f"{args.snapshot} has finished all {args.epochs} epochs: nothing left to train", file=sys.stderr)
        return

    epochs, totals = [], torch.zeros(4, dtype=torch.float64)
    for epoch in range(first_epoch, args.epochs + 1):
        sampler.set_epoch(epoch)
        sums, clocks = train_epoch(model, train_loader, optimizer, device, args, ctx, epoch,
                                   start_step if epoch == first_epoch else 0, snapshot)
        dist.all_reduce(sums)  # global sums over all ranks
        dist.all_reduce(clocks, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        scheduler.step()
        # The bare module: ranks run different numbers of test batches, and DDP's forward may talk to peers.
        test_totals = evaluate(net, test_loader, device)
        dist.all_reduce(test_totals)
        test_loss, correct, count = test_totals.tolist()
        if snapshot:
            snapshot(epoch + 1, 0)
        (loss_sum, samples, steady_samples), (epoch_s, steady_s, steps) = sums.tolist(), clocks.tolist()
        train_loss = loss_sum / max(samples, 1)  # a run resumed at the very end of an epoch trains no step in it
        totals += torch.tensor([samples, steady_samples, steady_s, steps], dtype=torch.float64)
        epochs.append(dict(epoch=epoch, train_time_s=epoch_s, train_loss=train_loss,
                           test_loss=test_loss / count, test_accuracy=correct / count, test_samples=int(count)))
        if ctx["master"]:
            print(f"epoch {epoch}: train loss {train_loss:.4f}, test loss {test_loss / count:.4f}, "
                  f"accuracy {correct / count:.2%} of {int(count)} images, {epoch_s:.1f} s", flush=True)

    peak_memory = torch.tensor(peak_memory_bytes(device), dtype=torch.float64, device=device)
    dist.all_reduce(peak_memory, op=dist.ReduceOp.MAX)
    record = metrics_record(args, ctx, epochs, totals.tolist() + [peak_memory.item()])
    if ctx["master"]:
        print(f"{MODE}: {record['samples_per_s'] or 0:.0f} samples/s, world size {ctx['world_size']}, {device}"
              + (" (synthetic data: accuracy is meaningless)" if args.synthetic else ""))
        if args.save_model:
            torch.save(net.state_dict(), args.save_model)
        if args.metrics_json:
            write_json_atomically(args.metrics_json, record)


def worker(local_rank, args):
    ctx = setup(args, local_rank)
    try:
        run(args, ctx)
    except RuntimeError as e:  # a peer died or timed out: say so in one line; other errors keep their traceback
        if not isinstance(e, dist.DistError) and not any(w in str(e).lower() for w in ("peer", "timed out")):
            raise
        fail(f"rank {ctx['rank']} lost its peers (did another process fail first?): {str(e).splitlines()[0]}")
    dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.master_port or free_port()))
    try:
        mp.spawn(worker, args=(args,), nprocs=args.nprocs)
    except mp.ProcessExitedException as e:  # the others have been stopped; one that failed has said why
        if e.signal_name:  # killed from outside: nobody has said anything yet
            print(f"error: process {e.error_index} was killed by {e.signal_name}; the others were stopped",
                  file=sys.stderr)
        sys.exit(e.exit_code if e.exit_code and e.exit_code > 0 else 1)


if __name__ == "__main__":
    main()
