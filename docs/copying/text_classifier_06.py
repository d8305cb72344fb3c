"""06 copied to a 4-class text classifier of the rows of --data-dir's train.csv and test.csv.

    torchrun --standalone --nproc_per_node 2 --max-restarts 3 text_classifier_06.py --snapshot s.pt
    torchrun --nnodes 2 --nproc_per_node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        --max-restarts 3 text_classifier_06.py --snapshot /shared/s.pt  # each machine: one path
"""
import argparse
import os
import sys
import tempfile
from datetime import timedelta  # 06
from types import SimpleNamespace

import torch
import torch.distributed as dist  # DDP
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP  # DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Net(nn.Module):  # a bag of words: the mean of a row's token embeddings, 4 classes
    def __init__(self, dropout=True):
        super().__init__()
        self.embed = nn.EmbeddingBag(1000, 64, mode="mean", padding_idx=0)  # 0: not in the mean
        self.dropout = nn.Dropout(0.5 if dropout else 0.0)
        self.fc = nn.Linear(64, 4)

    def forward(self, x):
        return self.fc(self.dropout(self.embed(x)))


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
    p.add_argument("--snapshot", type=writable, metavar="PATH", help="saved and resumed from")  # 06
    p.add_argument("--snapshot-every", type=in_range(0), default=0, help="also every N steps")
    p.add_argument("--timeout", type=in_range(1, cast=float), default=300, help="a wait's seconds")
    try:
        return p.parse_args(argv)
    except argparse.ArgumentError as e:
        sys.exit(f"error: {e}")  # one line on stderr, exit status 1


def lost(error):  # 06: the errors we can explain; a bug keeps its traceback
    known = (dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError)
    return isinstance(error, known) or "/gloo/transport/" in str(error).split("]")[0]


def attempt_store(args, rank):  # DDP: a restart must not read a killed attempt's keys
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # no torchrun agent: init_process_group makes a store
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),  # DDP
                          is_master=False, timeout=timedelta(seconds=args.timeout))  # 06
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
                            store=attempt_store(args, rank), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))  # 06: every wait
    return SimpleNamespace(device=device, rank=rank, world_size=world_size,
                           local_rank=local_rank, is_main=rank == 0)


class CSVText(Dataset):  # rows "label,token ids" of train.csv or test.csv, on the CPU
    def __init__(self, args, train, device):
        path = os.path.join(args.data_dir, "train.csv" if train else "test.csv")
        try:
            with open(path) as f:
                rows = [line.split(",") for line in f]
            self.tokens = [torch.tensor([int(t) for t in text.split()]) for _, text in rows]
            self.labels = [int(label) for label, _ in rows]
        except (OSError, ValueError) as e:
            sys.exit(f"error: {path} could not be read ({e}); a row: label,space-separated ids")

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, row):
        return self.tokens[row], self.labels[row]


def collate(batch):
    """The DataLoader's collate_fn: the Dataset's rows, as one batch (inputs, labels)."""
    tokens, labels = zip(*batch)
    return nn.utils.rnn.pad_sequence(tokens, batch_first=True), torch.tensor(labels)  # ids 0-padded


def batches(dataset, rows, batch_size, seed):
    seeds = torch.Generator().manual_seed(seed)  # the workers' seeds: not from dropout's RNG
    return DataLoader(dataset, batch_size, sampler=rows, collate_fn=collate, generator=seeds,
                      num_workers=2, pin_memory=torch.cuda.is_available(),  # files: pinned on CUDA
                      timeout=120)  # s: a worker stuck at its start ends the run, not waits forever


def load_data(args, rank, world_size, device):
    """This rank's share: training(epoch)'s full batches, shuffled; testing()'s rows, once."""
    train_set, test_set = CSVText(args, True, device), CSVText(args, False, device)
    sampler = DistributedSampler(train_set, world_size, rank, seed=args.seed)
    test_rows = range(rank, len(test_set), world_size)  # a sampler would repeat rows
    steps = min(len(sampler) // args.batch_size, args.max_steps or len(sampler))
    if steps == 0:
        sys.exit(f"error: --batch-size {args.batch_size} is more than the {len(sampler)} samples")
    def training(epoch, first):  # 06: a resumed epoch goes on from step first
        sampler.set_epoch(epoch)  # a new shuffle every epoch
        order = list(sampler)[first * args.batch_size:steps * args.batch_size]  # 06
        return batches(train_set, order, args.batch_size, args.seed + epoch)
    def testing():
        return batches(test_set, test_rows, args.test_batch_size, args.seed)
    return training, testing, steps  # 06: steps, for the snapshots' layout


def train_epoch(model, train_batches, optimizer, args, world, epoch, first, so_far, save):  # 06
    model.train()
    loss_sum = torch.tensor(so_far, device=world.device)  # 06: the sum so far, float32
    for step, (inputs, labels) in enumerate(train_batches, first):  # 06: from first
        optimizer.zero_grad(set_to_none=True)
        output = model(inputs.to(world.device, non_blocking=True))
        loss = F.cross_entropy(output, labels.to(world.device, non_blocking=True))
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach()  # on the device: no waiting for the GPU
        if world.is_main and args.log_interval and step % args.log_interval == 0:
            print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        if args.snapshot_every and (step + 1) % args.snapshot_every == 0:  # 06
            save(epoch, step + 1, loss_sum.item())  # 06: with the sum so far
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


def save_snapshot(args, world, net, optimizer, scheduler, epoch, step, layout, loss):  # 06
    """What an exact resume needs: weights, optimizer, schedule, position, RNGs, layout."""
    rngs = [None] * world.world_size
    gpu = None if world.device.type == "cpu" else torch.get_device_module(world.device)
    gpu = gpu and gpu.get_rng_state()  # each rank draws its own dropout masks
    dist.all_gather_object(rngs, (torch.get_rng_state(), gpu, loss))  # its dropout, its sum
    if world.is_main:
        state = dict(model=net.state_dict(), optimizer=optimizer.state_dict(), epoch=epoch,
                     scheduler=scheduler.state_dict(), step=step, rngs=rngs, layout=layout)
        torch.save(state, f"{args.snapshot}.tmp")  # a kill now leaves the last snapshot whole:
        os.replace(f"{args.snapshot}.tmp", args.snapshot)  # replaced only once written


def resume(path, world, net, optimizer, scheduler, layout):  # 06
    """(epoch, step, loss sum) to go on from: rank 0's copy, for all, if all see one."""
    state = seen = None
    if path and os.path.exists(path):
        try:
            state = torch.load(path, map_location="cpu")
            seen = (state["epoch"], state["step"], state["layout"])
        except Exception as e:
            seen = f"snapshot {path} could not be loaded ({type(e).__name__}); move it away"
    views = [None] * world.world_size
    dist.all_gather_object(views, seen)
    for error in [view for view in views if isinstance(view, str)]:  # all stop, not one
        sys.exit(f"error: {error}")
    if len(set(views)) > 1:
        said = ", ".join(f"rank {r}: {'none' if v is None else 'epoch %d step %d' % v[:2]}"
                         for r, v in enumerate(views))
        sys.exit(f"error: the ranks see different snapshots at --snapshot {path} ({said}): it "
                 "must be on a path every node sees")
    if seen is None:
        return 1, 0, 0.0
    if seen[2] != layout:  # another batch size, seed or world size: other samples
        sys.exit(f"error: snapshot {path} is from {seen[2]}, not {layout}: match it or move it")
    dist.broadcast_object_list(sent := [state], src=0)  # all resume rank 0's state
    state = sent[0]
    net.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    cpu_rng, gpu_rng, loss_sum = state["rngs"][world.rank]  # each rank's dropout masks go on
    torch.set_rng_state(cpu_rng)
    if gpu_rng is not None:
        torch.get_device_module(world.device).set_rng_state(gpu_rng)
    if world.is_main:
        print(f"resuming from {path}: epoch {state['epoch']}, step {state['step']}", flush=True)
    return state["epoch"], state["step"], loss_sum


def run(args, world):
    torch.manual_seed(args.seed + world.rank)  # DDP: own dropout; DDP copies rank 0's weights
    if world.local_rank != 0:
        dist.barrier()  # DDP: one process per machine downloads first
    training, testing, steps = load_data(args, world.rank, world.world_size, world.device)  # 06
    if world.local_rank == 0:
        dist.barrier()  # DDP: the files are there
    net = Net(dropout=not args.no_dropout).to(world.device)
    model = DDP(net)  # DDP: averages the gradients of all ranks in backward()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    layout = (f"world size {world.world_size}, --batch-size {args.batch_size}, "
              f"--seed {args.seed}, {steps} steps an epoch")  # 06: each step's samples
    def save(epoch, step, loss=0.0):  # 06: an epoch's end: after its test, as epoch + 1
        if args.snapshot and step < steps:  # loss: this rank's sum so far
            save_snapshot(args, world, net, optimizer, scheduler, epoch, step, layout, loss)

    epoch0, step0, sum0 = resume(args.snapshot, world, net, optimizer, scheduler, layout)  # 06
    if epoch0 > args.epochs:  # 06
        if world.is_main:
            print(f"{args.snapshot} has all {args.epochs} epochs: nothing to do", file=sys.stderr)
        return
    for epoch in range(epoch0, args.epochs + 1):  # 06
        first, so_far = (step0, sum0) if epoch == epoch0 else (0, 0.0)  # 06
        train_batches = training(epoch, first)  # 06
        train_loss = train_epoch(model, train_batches, optimizer, args, world, epoch,
                                 first, so_far, save)  # 06: snapshots on the way
        test = evaluate(net, testing(), world)
        scheduler.step()
        if epoch < args.epochs:  # 06: the last one once the outputs are written
            save(epoch + 1, 0)
        if world.is_main:
            print(f"epoch {epoch}: train loss {train_loss:.4f}, accuracy "
                  f"{test['test_accuracy']:.2%} of {test['test_samples']} test samples", flush=True)
    if world.is_main and args.save_model:
        torch.save(net.state_dict(), args.save_model)
    save(args.epochs + 1, 0)  # 06: after the outputs; a restart before redoes the last epoch


if __name__ == "__main__":
    args = parse_args()
    try:
        run(args, setup(args))
    except RuntimeError as e:  # 06: a lost peer or --timeout in one line; a bug: its traceback
        if not lost(e):
            raise
        stage = "stopped" if dist.is_initialized() else "could not join the others"
        sys.exit(f"error: rank {os.environ['RANK']} {stage} (a peer lost, or --timeout passed): "
                 f"{(str(e) or type(e).__name__).splitlines()[0]}")
    except SystemExit:  # 06: after an error line the group ends before Python does, or its
        if dist.is_initialized():  # threads may outlive it and abort the exit (SIGABRT)
            dist.destroy_process_group()
        raise
    dist.destroy_process_group()  # DDP
