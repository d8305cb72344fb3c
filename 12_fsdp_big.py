"""08 for a model too big for one GPU: sharded snapshots that resume on another number of GPUs.

    torchrun --standalone --nproc_per_node 4 --max-restarts 3 12_fsdp_big.py --snapshot s.pt
    torchrun --standalone --nproc_per_node 2 12_fsdp_big.py --snapshot s.pt --batch-size 128
"""
import argparse
import glob  # 12
import json  # measure
import math  # FSDP
import os
import shutil  # 12
import sys
import tempfile
import time  # measure
from types import SimpleNamespace

import torch
import torch.distributed as dist  # DDP
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed.checkpoint as dcp  # 12: each rank saves and loads its own shards
from torch.distributed._composable import checkpoint  # 12: activation checkpointing
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # FSDP
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # 12
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # 12
from torch.distributed.tensor import DTensor  # measure: FSDP, for held_bytes
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision import datasets


class Net(nn.Module):  # the classic PyTorch MNIST CNN, about 1.2 M parameters
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


def in_range(low, high=float("inf"), cast=int):  # an argparse type; NaN fails its test
    def number(text):
        if not low <= cast(text) < high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}), got {text}")
        return cast(text)
    return number


def writable(path):
    try:
        tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(path))).close()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {path}: {e.strerror}")
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"cannot write {path}: it is a folder")
    return path


def parse_args(argv=None):  # each flag checked now: a bad value must not cost a run
    p = argparse.ArgumentParser(description=__doc__, exit_on_error=False,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data-dir", default="data", help="the data's folder")
    p.add_argument("--synthetic", action="store_true", help="random data: speed only")  # measure
    p.add_argument("--epochs", type=in_range(1), default=1)
    p.add_argument("--batch-size", type=in_range(1), default=64, help="batch of this process")
    p.add_argument("--test-batch-size", type=in_range(1), default=1000)
    p.add_argument("--lr", type=in_range(0.0, cast=float), default=1.0, help="x0.7 each epoch")
    p.add_argument("--seed", type=in_range(0, 2**32), default=1)
    p.add_argument("--max-steps", type=in_range(0), default=0, help="steps per epoch (0: all)")
    p.add_argument("--log-interval", type=in_range(0), default=100, help="steps between lines")
    p.add_argument("--cpu", action="store_true", help="ignore GPUs")
    p.add_argument("--threads", type=in_range(0), default=0, help="CPU threads (0: PyTorch's)")
    p.add_argument("--no-dropout", action="store_true", help="for exact comparisons of modes")
    p.add_argument("--save-model", type=writable, metavar="PATH", help="save the weights here")
    p.add_argument("--metrics-json", type=writable, metavar="PATH", help="the record")  # measure
    p.add_argument("--snapshot", type=writable, metavar="PATH", help="saved and resumed from")  # 12
    p.add_argument("--snapshot-every", type=in_range(0), default=0, help="also every N steps")  # 12
    p.add_argument("--mixed-precision", choices=["fp32", "bf16"], default="fp32", help="compute in")
    p.add_argument("--checkpoint-activations", action="store_true", help="recompute in backward")
    try:
        return p.parse_args(argv)
    except argparse.ArgumentError as e:
        sys.exit(f"error: {e}")  # one line on stderr, exit status 1


def attempt_store(rank):  # DDP: a restart must not read a killed attempt's keys
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # no torchrun agent: init_process_group makes a store
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),  # DDP
                          is_master=False)  # torchrun's, kept across attempts
    starts = store.add(f"starts/rank{rank}", 1)  # DDP: 1, then 2 after a restart
    return dist.PrefixStore(f"attempt{starts}/", store)  # DDP


def setup(args):  # where this process trains, and whether it is the main one
    if "RANK" not in os.environ:  # DDP: torchrun tells each process who it is
        sys.exit(f"error: start me with torchrun --standalone --nproc_per_node N {__file__}")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # DDP
    local_rank, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])  # DDP
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    device = torch.device("cpu") if args.cpu or accelerator is None else accelerator
    if device.type == "mps":  # DDP: no backend takes MPS tensors today
        print("DDP cannot use MPS: training on the CPU", file=sys.stderr)
        device = torch.device("cpu")
    if device.type != "cpu":  # DDP: one GPU per process, current for collectives
        if per_node > torch.accelerator.device_count():
            sys.exit(f"error: {per_node} processes on this machine but "
                     f"{torch.accelerator.device_count()} GPU(s): start fewer, or add --cpu")
        device = torch.device(device.type, local_rank)
        torch.accelerator.set_device_index(local_rank)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    backend = dist.get_default_backend_for_device(device)  # DDP: gloo on CPUs, nccl on CUDA
    backend = backend if dist.is_backend_available(backend) else "gloo"  # Windows: no NCCL
    dist.init_process_group(backend, device_id=None if device.type == "cpu" else device,
                            store=attempt_store(rank), rank=rank, world_size=world_size)  # DDP
    return SimpleNamespace(device=device, rank=rank, world_size=world_size,
                           local_rank=local_rank, is_main=rank == 0)


class MNIST(Dataset):  # one split, kept on the device: no input pipeline
    def __init__(self, args, train, device):
        if args.synthetic:  # measure
            self.images, self.labels = random_mnist(args.seed + train, train, device)  # measure
            return  # measure
        try:
            mnist = datasets.MNIST(args.data_dir, train=train, download=True)
        except Exception as e:
            cause = (str(e).strip() or type(e).__name__).splitlines()[-1]
            sys.exit(f"error: cannot load MNIST from {args.data_dir} ({cause}); a corrupt file: "
                     f"delete it; offline: copy the raw files into {args.data_dir}/MNIST/raw/")
        images = (mnist.data.unsqueeze(1) / 255 - 0.1307) / 0.3081  # MNIST's mean and std
        self.images, self.labels = images.to(device), mnist.targets.to(device)

    def __len__(self):
        return len(self.labels)

    def __getitems__(self, rows):  # a DataLoader's batch of rows in one indexing
        index = torch.tensor(rows).to(self.labels.device, non_blocking=True)
        return self.images[index], self.labels[index]


def collate(batch):
    """The DataLoader's collate_fn: the Dataset's rows, as one batch (inputs, labels)."""
    return batch


def batches(dataset, rows, batch_size, seed):
    seeds = torch.Generator().manual_seed(seed)  # the workers' seeds: not from dropout's RNG
    return DataLoader(dataset, batch_size, sampler=rows, collate_fn=collate, generator=seeds,
                      num_workers=0, pin_memory=False)  # files: 2-8 workers, pinned on CUDA


def load_data(args, rank, world_size, device):
    """This rank's share: training(epoch)'s full batches, shuffled; testing()'s rows, once."""
    train_set, test_set = MNIST(args, True, device), MNIST(args, False, device)
    sampler = DistributedSampler(train_set, world_size, rank, seed=args.seed)
    test_rows = range(rank, len(test_set), world_size)  # a sampler would repeat rows
    steps = min(len(sampler) // args.batch_size, args.max_steps or len(sampler))
    if steps == 0:
        sys.exit(f"error: --batch-size {args.batch_size} is more than the {len(sampler)} samples")
    def training(epoch, first):  # 12: a resumed epoch goes on from step first
        sampler.set_epoch(epoch)  # a new shuffle every epoch
        order = list(sampler)[first * args.batch_size:steps * args.batch_size]  # 12
        return batches(train_set, order, args.batch_size, args.seed + epoch)
    def testing():
        # FSDP: every rank runs as many test batches as rank 0, since each forward all-gathers.
        count = math.ceil(len(test_set) / world_size / args.test_batch_size)  # FSDP
        split = torch.tensor(test_rows).tensor_split(count)  # FSDP
        return DataLoader(test_set, batch_sampler=[rows.tolist() for rows in split],  # FSDP
                          collate_fn=collate, generator=torch.Generator())
    return training, testing, steps  # 12


def train_epoch(model, train_batches, optimizer, args, world, epoch, first, so_far, save):  # 12
    model.train()
    loss_sum = torch.tensor(so_far, device=world.device)  # 12: the sum so far, float32
    for step, (inputs, labels) in enumerate(train_batches, first):  # 12: from first
        optimizer.zero_grad(set_to_none=True)
        output = model(inputs.to(world.device, non_blocking=True))
        loss = F.cross_entropy(output, labels.to(world.device, non_blocking=True))
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach()  # on the device: no waiting for the GPU
        if world.is_main and args.log_interval and step % args.log_interval == 0:
            print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        if args.snapshot_every and (step + 1) % args.snapshot_every == 0:  # 12
            save(epoch, step + 1, loss_sum.item())  # 12: with the sum so far
    dist.all_reduce(loss_sum)  # DDP: summed over ranks, which all took as many steps
    return loss_sum.item() / (step + 1) / world.world_size


@torch.no_grad()
def evaluate(net, test_batches, world):
    net.eval()
    for buffer in net.buffers():  # DDP: all test rank 0's model (BatchNorm's statistics)
        dist.broadcast(buffer, 0)
    loss_sum, correct, count = 0.0, 0, 0
    for inputs, labels in test_batches:
        inputs, labels = inputs.to(world.device), labels.to(world.device)
        output = net(inputs)
        loss_sum += F.cross_entropy(output, labels, reduction="sum").item()
        correct += (output.argmax(dim=1) == labels).sum().item()
        count += len(labels)  # counted, not assumed: a dropped or a repeated row would show
    totals = torch.tensor([loss_sum, correct, count], device=world.device)  # DDP
    dist.all_reduce(totals)  # DDP: the sums of every rank's share
    loss_sum, correct, count = totals.tolist()
    return dict(test_loss=loss_sum / count, test_accuracy=correct / count, test_samples=int(count))


def resume(args, world, model, optimizer, scheduler, layout):  # 12: (epoch, step, loss sum)
    found = [None]  # rank 0 reads which shards are the last; each rank then reads its own
    if world.is_main and args.snapshot and os.path.exists(args.snapshot):
        try:
            found = [torch.load(args.snapshot, map_location="cpu")]
            os.stat(os.path.join(found[0]["shards"], ".metadata"))  # DCP writes it last
        except Exception as e:
            found = [f"cannot load snapshot {args.snapshot} ({type(e).__name__}); move it away"]
    dist.broadcast_object_list(found, src=0)
    if isinstance(state := found[0], str) or state and state["layout"] != layout:
        sys.exit(f"error: {state}" if isinstance(state, str) else f"error: snapshot {args.snapshot}"
                 f" is of {state['layout']}, not {layout}: match it or move it")
    if state is None:
        return 1, 0, 0.0
    weights, moments = get_state_dict(model, optimizer)
    dcp.load(dict(model=weights, optimizer=moments), checkpoint_id=state["shards"])  # resharded
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=moments)
    scheduler.load_state_dict(state["scheduler"])
    cpu_rng, gpu_rng, loss_sum = state["rngs"][world.rank % len(state["rngs"])]
    if len(state["rngs"]) == world.world_size:  # the same ranks: each one's masks go on
        torch.set_rng_state(cpu_rng)
        if gpu_rng is not False:
            torch.get_device_module(world.device).set_rng_state(gpu_rng)
    else:  # other ranks: other masks, and an equal share of the loss so far
        loss_sum = sum(loss for _, _, loss in state["rngs"]) / len(state["rngs"])
    print(f"resuming from {state['shards']}: epoch {state['epoch']}, step {state['step']}")
    return state["epoch"], state["step"], loss_sum


def run(args, world):
    torch.manual_seed(args.seed)  # FSDP: the same weights on all (fully_shard copies none)
    if world.local_rank != 0:
        dist.barrier()  # DDP: one process per machine downloads first
    training, testing, steps = load_data(args, world.rank, world.world_size, world.device)  # 12
    if world.local_rank == 0:
        dist.barrier()  # DDP: the files are there
    net = Net(dropout=not args.no_dropout).to(world.device)
    torch.manual_seed(args.seed + world.rank)  # FSDP: its own dropout
    mesh = dist.init_device_mesh(world.device.type, (world.world_size,))  # FSDP: our device
    low = torch.bfloat16 if args.mixed_precision == "bf16" else None  # 12: for compute
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)  # 12
    if args.checkpoint_activations:  # 12: forward keeps its input; backward reruns it
        checkpoint(net)  # 12: the whole Net is one block here; in a transformer, each block
    for layer in net.children():  # FSDP: layer by layer, each gathered only while it runs
        fully_shard(layer, mesh=mesh, mp_policy=policy)  # 12
    model = fully_shard(net, mesh=mesh, mp_policy=policy)  # 12: the root; shards stay fp32
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    layout = (f"{sum(p.numel() for p in model.parameters()):,} weights, global batch "  # 12
              f"{args.batch_size * world.world_size}, --seed {args.seed}, {steps} steps an epoch")
    def save(epoch, step, loss=0.0):  # 12: loss: this rank's sum so far
        if not args.snapshot or step == steps:  # an epoch's end: after its test, as epoch + 1
            return
        gpu = world.device.type != "cpu" and torch.get_device_module(world.device)
        rngs = [None] * world.world_size  # each rank's dropout RNG and loss sum
        dist.all_gather_object(rngs, (torch.get_rng_state(), gpu and gpu.get_rng_state(), loss))
        shards = f"{args.snapshot}.epoch{epoch}-step{step}"  # beside the last, which stays
        weights, moments = get_state_dict(model, optimizer)  # this rank's shards, as DTensors
        dcp.save(dict(model=weights, optimizer=moments), storage_writer=dcp.FileSystemWriter(
            shards, overwrite=True))  # each rank its own file; passed: the default changes
        if world.is_main:  # the rest, and which shards are the last: one small file, as in 06
            state = dict(scheduler=scheduler.state_dict(), epoch=epoch, step=step, rngs=rngs)
            torch.save(dict(state, layout=layout, shards=shards), f"{args.snapshot}.tmp")
            os.replace(f"{args.snapshot}.tmp", args.snapshot)  # the switch, in one step
            for old in set(glob.glob(glob.escape(args.snapshot) + ".epoch*")) - {shards}:
                shutil.rmtree(old)  # the older shards go: one snapshot is kept
    started = time.perf_counter()  # measure
    epoch0, step0, sum0 = resume(args, world, model, optimizer, scheduler, layout)  # 12
    load_s = time.perf_counter() - started  # measure
    if epoch0 > args.epochs:  # 12: each rank says so
        print(f"{args.snapshot} has all {args.epochs} epochs: nothing to do", file=sys.stderr)
        return
    epochs = []  # measure
    for epoch in range(epoch0, args.epochs + 1):  # 12
        first, so_far = (step0, sum0) if epoch == epoch0 else (0, 0.0)  # 12
        train_batches = training(epoch, first)  # 12
        train_batches = timed(train_batches, world, epochs)  # measure
        train_loss = train_epoch(model, train_batches, optimizer, args, world, epoch,
                                 first, so_far, save)  # 12: snapshots on the way
        test = evaluate(net, testing(), world)
        epochs[-1].update(epoch=epoch, train_loss=train_loss, **test)  # measure
        scheduler.step()
        if epoch < args.epochs:  # 12: the last one once the weights are saved
            save(epoch + 1, 0)
        if world.is_main:
            print(f"epoch {epoch}: train loss {train_loss:.4f}, accuracy "
                  f"{test['test_accuracy']:.2%} of {test['test_samples']} test samples", flush=True)
    epochs[-1].update(held_bytes(model, optimizer, world))  # measure
    if args.save_model:  # FSDP: all send their shards, rank 0 saves one plain state dict
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)  # empty on the other ranks
        if world.is_main:
            torch.save(weights, args.save_model)
    started = time.perf_counter()  # measure
    save(args.epochs + 1, 0)  # 12: after the weights; a restart before redoes the last epoch
    kept = world.is_main and glob.glob(glob.escape(str(args.snapshot)) + ".epoch*/__*")  # measure
    epochs[-1].update(snapshot_bytes={os.path.basename(f): os.path.getsize(f) for f in kept or ()},
                      snapshot_load_s=load_s, snapshot_save_s=time.perf_counter() - started)
    world.mode = "fsdp_big"  # 12  # measure
    write_record(args.metrics_json, args, world, epochs)  # measure


def held_bytes(model, optimizer, world):  # FSDP  # measure: each rank's bytes, and DDP's copy
    tensors = [t for p, state in optimizer.state.items()  # measure: weights, gradients, state
               for t in [p, p.grad, *state.values()] if isinstance(t, DTensor)]  # measure
    held = [None] * world.world_size  # measure: every rank's shards, for rank 0's record
    dist.all_gather_object(held, sum(t.to_local().nbytes for t in tensors))  # measure
    full = sum(t.numel() * t.element_size() for t in tensors)  # measure: global sizes
    return dict(bytes_per_rank=held, full_copy_bytes=full)  # measure


# ---- Measurement, for bench/ alone: delete it to `if __name__`, and the lines marked # measure.
WARMUP_STEPS = 5  # not in samples_per_s: the first steps pay for allocation and kernel choice


def random_mnist(seed, train, device):
    rng = torch.Generator().manual_seed(seed)
    images = torch.randn(60000 if train else 10000, 1, 28, 28, generator=rng)
    return images.to(device), torch.randint(0, 10, (len(images),), generator=rng).to(device)


def clock(device):  # seconds once the device is done: GPU work is queued
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    return time.perf_counter()


def timed(train_batches, world, epochs):  # the same batches; the epoch's timing into epochs
    starts = []
    for step, (inputs, labels) in enumerate(train_batches):
        if step <= (0 if epochs else WARMUP_STEPS):
            starts.append(clock(world.device))  # only these steps wait for the device
        yield inputs, labels
    epochs.append(timing(world, starts, step + 1, len(labels)))


def timing(world, starts, steps, batch):  # all ranks' samples in the slowest rank's time
    seconds = [clock(world.device) - start for start in (starts[0], starts[-1])]
    if torch.distributed.is_initialized():
        seconds = torch.tensor(seconds, dtype=torch.float64, device=world.device)
        torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
    batch *= getattr(world, "data_ranks", world.world_size)  # a shared batch counts once
    peaks = [torch.accelerator.max_memory_allocated(d) if d.type != "cpu" else None
             for d in getattr(world, "devices", [world.device])]  # DataParallel: one per GPU
    return dict(steps=steps, train_samples=steps * batch, train_time_s=float(seconds[0]),
                steady_samples=(steps - len(starts) + 1) * batch, steady_time_s=float(seconds[1]),
                peak_memory_bytes=max(peaks), peak_memory_per_device=peaks)  # CPU: None


def write_record(path, args, world, epochs):  # what only the run knows
    if not world.is_main:
        return
    chips, last, group = getattr(world, "devices", [world.device]), epochs[-1], world.world_size
    sums = {k: sum(e[k] for e in epochs) for k in ["steps", "steady_samples", "steady_time_s"]}
    record = dict(
        schema=1, script=os.path.basename(__file__), mode=world.mode, lr=args.lr,
        torch_version=torch.__version__, threads=torch.get_num_threads(), synthetic=args.synthetic,
        device_names=[torch.cuda.get_device_name(d) if d.type == "cuda" else d.type for d in chips],
        nodes=getattr(world, "nodes", group // int(os.environ.get("LOCAL_WORLD_SIZE", group))),
        backend=torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        device_type=world.device.type, world_size=group * len(chips), **sums, epochs_detail=epochs,
        per_device_batch=args.batch_size // len(chips), peak_memory_bytes=last["peak_memory_bytes"],
        global_batch=last["train_samples"] // last["steps"], epochs=args.epochs, argv=sys.argv,
        train_samples=sum(e["train_samples"] for e in epochs), test_accuracy=last["test_accuracy"],
        samples_per_s=sums["steady_samples"] / sums["steady_time_s"], test_loss=last["test_loss"])
    print(f"{os.path.basename(__file__)}: {record['samples_per_s']:.0f} samples/s, world size "
          f"{record['world_size']}, {world.device}{', random data' if args.synthetic else ''}")
    if path:  # whole or not at all: renamed once written
        with open(f"{path}.tmp", "w") as f:
            json.dump(record, f, indent=2)
        os.replace(f"{path}.tmp", path)


if __name__ == "__main__":
    args = parse_args()
    run(args, setup(args))
    dist.destroy_process_group()  # DDP
