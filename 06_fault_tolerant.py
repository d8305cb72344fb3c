"""03 plus fault tolerance: snapshots that resume exactly, restarts by torchrun, bounded waits.

    torchrun --standalone --nproc_per_node 2 --max-restarts 3 06_fault_tolerant.py --snapshot s.pt
    torchrun --nnodes 2 --nproc_per_node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        --max-restarts 3 06_fault_tolerant.py --snapshot /shared/s.pt   # on each machine
A killed process makes torchrun restart them all; they resume from the last snapshot, which rank 0
writes and sends to every rank. After a restart rank 0 may be on another node: give a path that
every node sees, as above. --timeout bounds every wait.
"""
import argparse
import fcntl
import json
import math
import os
import resource
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler
from torchvision import datasets

MODE = "ddp_fault_tolerant"
WARMUP_STEPS = 5  # left out of samples_per_s: first steps pay for allocation and kernel selection
POSITIVE = ["epochs", "batch_size", "test_batch_size", "lr", "timeout"]  # values > 0
NOT_NEGATIVE = ["max_steps", "log_interval", "threads", "snapshot_every"]  # values >= 0

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
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        return self.fc2(x)

def fail(message):
    """Bad input ends the run with one line on stderr, never a traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)

def parse_args(argv=None):
    """The flags, every value checked before any work starts: a bad one must not cost a run."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data-dir", default="data", help="torchvision's MNIST (downloaded if missing)")
    p.add_argument("--synthetic", action="store_true", help="random MNIST-shaped data (throughput)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64, help="batch of this process")
    p.add_argument("--test-batch-size", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1.0, help="Adadelta's rate, x0.7 each epoch")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0, help="steps per epoch at most (0: all)")
    p.add_argument("--log-interval", type=int, default=100, help="steps between lines (0: none)")
    p.add_argument("--cpu", action="store_true", help="ignore GPUs")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: cores / processes)")
    p.add_argument("--no-dropout", action="store_true", help="for exact comparisons of modes")
    p.add_argument("--save-model", metavar="PATH", help="save the trained weights here")
    p.add_argument("--metrics-json", metavar="PATH", help="write the run's metrics record here")
    p.add_argument("--snapshot", metavar="PATH", help="saved each epoch; resumed from if it exists")
    p.add_argument("--snapshot-every", type=int, default=0, metavar="N", help="also every N steps")
    p.add_argument("--timeout", type=float, default=300, help="seconds to wait for the others")
    args = p.parse_args(argv)
    for name in POSITIVE + NOT_NEGATIVE:
        value = getattr(args, name)
        if not (0 < value < math.inf if name in POSITIVE else 0 <= value < math.inf):  # NaN too
            kind = "positive" if name in POSITIVE else "zero or more"
            fail(f"--{name.replace('_', '-')} must be {kind}, got {value}")
    if not 0 <= args.seed < 2**32:
        fail(f"--seed must be in 0..2**32-1, got {args.seed}")
    for path in filter(None, [args.metrics_json, args.save_model, args.snapshot]):  # those given
        if os.path.isdir(path) or not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            fail(f"cannot write {path}: its folder does not exist or is not writable")
    return args

def first_line(error):
    """An exception in one line: its message's first, or its type when it has no message."""
    return (str(error) or type(error).__name__).splitlines()[0]

def attempt_store(args, rank):
    """torchrun's agent keeps one store across restarts, holding the dead attempt's keys, and counts
    restarts per node (TORCHELASTIC_RESTART_COUNT differs between nodes). Keys under a prefix that
    every rank agrees on, how often this rank has started, keep the attempts apart."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # no agent store: init_process_group makes a fresh one
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=args.timeout))
    starts = store.add(f"starts/rank{rank}", 1)
    return dist.PrefixStore(f"attempt{starts}/", store)

def setup(args):
    """The one place that decides the device (in the DDP scripts: rank and world size too)."""
    if "RANK" not in os.environ:
        fail(f"start me with torchrun: torchrun --standalone --nproc_per_node N {__file__}")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])  # its number, and how many, on its machine
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    cuda = torch.cuda.is_available() and not args.cpu
    devices = [torch.device("cuda", local_rank)] if cuda else [torch.device("cpu")]
    if cuda:  # object collectives (the snapshot's RNG states) run on the current GPU
        torch.cuda.set_device(devices[0])
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // local_world_size)  # shared
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("nccl" if cuda else "gloo", store=attempt_store(args, rank),
                                rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=args.timeout),
                                device_id=devices[0] if cuda else None)
    except dist.DistError as e:
        fail(f"rank {rank} could not join the others: {first_line(e)}")
    return dict(rank=rank, world_size=world_size, nodes=world_size // local_world_size,
                backend=dist.get_backend(), master=rank == 0, local_rank=local_rank,
                threads=threads, device=devices[0], devices=devices)

def load_mnist(args, train):
    """(images, labels) of one split, normalised once: the input pipeline is never what we time."""
    if args.synthetic:
        rng = torch.Generator().manual_seed(args.seed + train)
        n = 60000 if train else 10000
        return torch.randn(n, 1, 28, 28, generator=rng), torch.randint(0, 10, (n,), generator=rng)
    try:
        os.makedirs(args.data_dir, exist_ok=True)
        with open(os.path.join(args.data_dir, "download.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # nodes that share this folder download it once
            mnist = datasets.MNIST(args.data_dir, train=train, download=True)
    except Exception as e:
        fail(f"MNIST could not be loaded from {args.data_dir}/MNIST/raw ({type(e).__name__}: "
             f"{str(e)[:150]!r}); delete a corrupt file to download it again, or use --synthetic")
    return (mnist.data.unsqueeze(1) / 255 - 0.1307) / 0.3081, mnist.targets  # MNIST's mean, std

def batches(data, indices, batch_size):
    """Batches sliced from tensors on the device: no step waits for the host or a DataLoader."""
    images, labels = data
    index = torch.tensor(list(indices), device=images.device)
    for batch in index.split(batch_size):
        yield images[batch], labels[batch]

def clock(device):
    """Seconds, read once the device has done its work: GPU work is queued, not yet done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()

def peak_memory_bytes(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak RSS (KiB on Linux)

def all_ranks(value, device, op=dist.ReduceOp.SUM):
    """value summed over all ranks (or their maximum, with op=MAX), on every rank."""
    tensor = torch.as_tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.item()

def rng_state(device):
    """The generators dropout draws from: the CPU's, and the GPU's where it runs."""
    gpu = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), gpu

def save_snapshot(path, ctx, net, optimizer, scheduler, epoch, step):
    """All an exact resume needs: weights, optimizer, schedule, position and every rank's RNG."""
    rngs = [None] * ctx["world_size"]
    dist.all_gather_object(rngs, rng_state(ctx["device"]))
    if ctx["master"]:
        state = dict(model=net.state_dict(), optimizer=optimizer.state_dict(),
                     scheduler=scheduler.state_dict(), epoch=epoch, step=step, rngs=rngs)
        torch.save(state, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)  # a kill during the save leaves the last snapshot whole

def resume(path, ctx, net, optimizer, scheduler):
    """(epoch, step) to go on from. Rank 0 reads the snapshot and sends it to every rank: all resume
    the same state, or all stop. (1, 0) when there is none."""
    state = [None]
    if ctx["master"] and path and os.path.exists(path):
        try:
            state = [torch.load(path, map_location="cpu")]
        except Exception as e:
            state = [f"snapshot {path} could not be loaded ({type(e).__name__}); move it away"]
    dist.broadcast_object_list(state, src=0, device=ctx["device"])
    state = state[0]
    if state is None:
        return 1, 0
    if isinstance(state, str) or len(state["rngs"]) != ctx["world_size"]:
        fail(state if isinstance(state, str) else f"snapshot {path} is from another world size")
    net.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    cpu_rng, gpu_rng = state["rngs"][ctx["rank"]]  # each rank's own dropout masks go on
    torch.set_rng_state(cpu_rng)
    if gpu_rng is not None:
        torch.cuda.set_rng_state(gpu_rng, ctx["device"])
    if ctx["master"]:
        print(f"resuming from {path}: epoch {state['epoch']}, step {state['step']}", flush=True)
    return state["epoch"], state["step"]

def train_epoch(model, data, sampler, optimizer, args, ctx, epoch, start_step=0, save=None):
    """One epoch of this process's share of the data."""
    model.train()
    device = ctx["device"]
    steps = len(sampler) // args.batch_size  # full batches only: one shape for every step
    steps = min(steps, args.max_steps or steps)
    warmup = min(start_step + WARMUP_STEPS, steps - 1) if epoch == 1 or start_step else 0
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for each_device in ctx["devices"]:  # on GPUs: the peak of training, not of loading the data
        if each_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(each_device)
    start = steady_start = clock(device)
    order = list(sampler)[start_step * args.batch_size:steps * args.batch_size]  # what is left
    for step, (images, labels) in enumerate(batches(data, order, args.batch_size), start_step):
        if step == warmup:
            steady_start = clock(device)
        optimizer.zero_grad(set_to_none=True)
        output = model(images)
        loss = F.cross_entropy(output, labels)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach() * len(labels)  # summed on the device: no waiting for the GPU
        if ctx["master"] and args.log_interval and step % args.log_interval == 0:
            print(f"epoch {epoch} step {step}/{steps} loss {loss.item():.4f}", flush=True)
        last = step + 1 == steps  # the end of an epoch is saved after its evaluation
        if save and args.snapshot_every and (step + 1) % args.snapshot_every == 0 and not last:
            save(epoch, step + 1)
    end = clock(device)
    loss_sum = all_ranks(loss_sum, device)  # totals over all ranks
    samples = int(all_ranks((steps - start_step) * args.batch_size, device))
    steady_samples = int(all_ranks((steps - warmup) * args.batch_size, device))
    time_s = all_ranks(end - start, device, dist.ReduceOp.MAX)  # the slowest rank sets the pace
    steady_time_s = all_ranks(end - steady_start, device, dist.ReduceOp.MAX)
    memory = [int(all_ranks(peak_memory_bytes(device), device, dist.ReduceOp.MAX))]
    return dict(steps=steps, train_samples=samples, steady_samples=steady_samples,
                train_loss=loss_sum / samples, train_time_s=time_s, steady_time_s=steady_time_s,
                peak_memory_bytes=max(memory), peak_memory_per_device=memory)

@torch.no_grad()
def evaluate(net, data, indices, args, ctx):
    """Loss and accuracy on the test set: this process scores its share (in DDP: totals of all)."""
    net.eval()
    loss_sum, correct, count = 0.0, 0, len(indices)
    for images, labels in batches(data, indices, args.test_batch_size):
        output = net(images)
        loss_sum += F.cross_entropy(output, labels, reduction="sum").item()
        correct += (output.argmax(dim=1) == labels).sum().item()
    loss_sum, correct, count = (all_ranks(x, ctx["device"]) for x in (loss_sum, correct, count))
    return dict(test_loss=loss_sum / count, test_accuracy=correct / count, test_samples=int(count))

def metrics_record(args, ctx, epochs):
    """The run's record, for the harness in bench/ (keys are added, never renamed)."""
    steady_samples = sum(e["steady_samples"] for e in epochs)
    steady_time_s = sum(e["steady_time_s"] for e in epochs)
    names = [torch.cuda.get_device_name(d) if d.type == "cuda" else "cpu" for d in ctx["devices"]]
    return dict(
        schema=1, script=os.path.basename(__file__), mode=MODE, device_type=ctx["device"].type,
        device_names=names, world_size=ctx["world_size"], nodes=ctx["nodes"], lr=args.lr,
        backend=ctx["backend"], threads=ctx["threads"], epochs=len(epochs), argv=sys.argv,
        per_device_batch=args.batch_size, global_batch=args.batch_size * ctx["world_size"],
        train_samples=sum(e["train_samples"] for e in epochs), steady_samples=steady_samples,
        steps=sum(e["steps"] for e in epochs), samples_per_s=steady_samples / steady_time_s,
        steady_time_s=steady_time_s, epochs_detail=epochs, torch_version=torch.__version__,
        test_accuracy=epochs[-1]["test_accuracy"], test_loss=epochs[-1]["test_loss"],
        peak_memory_bytes=max(e["peak_memory_bytes"] for e in epochs), synthetic=args.synthetic)

def run(args, ctx):
    device = ctx["device"]
    torch.manual_seed(args.seed + ctx["rank"])  # its own dropout masks; DDP copies rank 0's weights
    if ctx["local_rank"] != 0:
        dist.barrier()  # one process per node downloads; the others wait, then read its files
    train_data = [t.to(device) for t in load_mnist(args, train=True)]  # 188 MB: fits any GPU
    test_data = [t.to(device) for t in load_mnist(args, train=False)]
    if ctx["local_rank"] == 0:
        dist.barrier()
    train_size, test_size = len(train_data[1]), len(test_data[1])
    # Each replica trains on its share of every epoch's shuffle (01 and 02 have one: all of it).
    sampler = DistributedSampler(range(train_size), ctx["world_size"], ctx["rank"], seed=args.seed)
    # Each rank tests every world_size-th image: all of them exactly once, no padded repeats.
    test_indices = range(ctx["rank"], test_size, ctx["world_size"])
    if len(sampler) < args.batch_size:
        fail(f"--batch-size {args.batch_size} is more than the {len(sampler)} training images")
    net = Net(dropout=not args.no_dropout).to(device)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)

    def save(epoch, step):
        save_snapshot(args.snapshot, ctx, net, optimizer, scheduler, epoch, step)

    first_epoch, start_step = resume(args.snapshot, ctx, net, optimizer, scheduler)
    if first_epoch > args.epochs:
        if ctx["master"]:
            print(f"{args.snapshot} has all {args.epochs} epochs: nothing to do", file=sys.stderr)
        return

    epochs = []
    for epoch in range(first_epoch, args.epochs + 1):
        sampler.set_epoch(epoch)
        first_step = start_step if epoch == first_epoch else 0
        train = train_epoch(model, train_data, sampler, optimizer, args, ctx, epoch,
                            start_step=first_step, save=save if args.snapshot else None)
        test = evaluate(net, test_data, test_indices, args, ctx)
        epochs.append(dict(epoch=epoch, lr=scheduler.get_last_lr()[0], **train, **test))
        scheduler.step()
        if args.snapshot and epoch < args.epochs:  # the last one once the outputs are written
            save(epoch + 1, 0)
        if ctx["master"]:
            print(f"epoch {epoch}: train loss {train['train_loss']:.4f}, accuracy "
                  f"{test['test_accuracy']:.2%} of {test['test_samples']} test images", flush=True)
    record = metrics_record(args, ctx, epochs)
    if ctx["master"]:
        note = " (synthetic data: the accuracy means nothing)" if args.synthetic else ""
        print(f"{MODE}: {record['samples_per_s']:.0f} samples/s, world size {ctx['world_size']}, "
              f"{device}{note}")
        if args.save_model:
            torch.save(net.state_dict(), args.save_model)
        if args.metrics_json:  # whole or not at all: renamed once written
            with open(f"{args.metrics_json}.tmp", "w") as f:
                json.dump(record, f, indent=2)
            os.replace(f"{args.metrics_json}.tmp", args.metrics_json)
    if args.snapshot:  # after the outputs: a restart before this redoes the last epoch
        save(args.epochs + 1, 0)

if __name__ == "__main__":
    args = parse_args()
    ctx = setup(args)
    try:
        run(args, ctx)
    except RuntimeError as e:  # a peer died (gloo: RuntimeError) or --timeout passed: one line
        fail(f"rank {ctx['rank']} stopped (did another fail first?): {first_line(e)}")
    dist.destroy_process_group()
