"""MNIST as a LightningModule and a Trainer: 03's training, with Lightning writing the loops.

    python 07_lightning.py                                     # 01: one device
    python 07_lightning.py --devices 2                         # 03: Lightning starts 2 processes
    python 07_lightning.py --devices 2 --strategy ddp_spawn    # 04: torch.multiprocessing.spawn
    torchrun --standalone --nproc_per_node 2 07_lightning.py --devices 2     # 03 under torchrun
    torchrun --nnodes 2 --nproc_per_node 4 --node_rank R --master_addr HOST --master_port PORT \\
        07_lightning.py --devices 4 --num-nodes 2              # 05: on each of 2 machines
    MASTER_ADDR=HOST MASTER_PORT=PORT NODE_RANK=R python 07_lightning.py --devices 4 --num-nodes 2
    srun --nodes 2 --ntasks-per-node 4 python 07_lightning.py --devices 4 --num-nodes 2   # SLURM
    python 07_lightning.py --devices 2 --synthetic --max-steps 100  # measure: speed only

02 has no equivalent: Lightning 2 removed strategy="dp" (use DDP). Under torchrun or SLURM,
--devices and --num-nodes must match the processes the launcher starts (checked before any work).
A LightningModule is an nn.Module (a subclass, not a superclass), and its hooks are Lightning 2's:
train_dataloader (once tng_dataloader), configure_optimizers, on_validation_epoch_end (once
validation_end); metrics go to a Callback or self.log (once update_tng_log_metrics).
"""
import argparse
import json  # measure
import logging  # Lightning: its lines, quietened below
import os
import sys
import tempfile
import time  # measure
import warnings  # Lightning
from types import SimpleNamespace

import lightning as L  # Lightning
import torch
import torch.distributed as dist  # DDP
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric.plugins.environments import SLURMEnvironment  # Lightning
from lightning.pytorch.strategies import DDPStrategy  # Lightning
from lightning.pytorch.utilities import disable_possible_user_warnings  # Lightning
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision import datasets

# Lightning: output like 03's, without "GPU available" lines or advice on workers; at import,
# so that ddp_spawn's processes (they import this file, not run it) are quiet too.
for name in ["lightning.pytorch", "lightning.fabric"]:
    logging.getLogger(name).setLevel(logging.WARNING)
disable_possible_user_warnings()
warnings.filterwarnings("ignore", ".*LeafSpec.*", FutureWarning)  # from a newer torch


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
    # Lightning: the Trainer's own flags; under torchrun or srun, what the launcher started
    p.add_argument("--devices", type=in_range(1), default=1, help="processes per machine")
    p.add_argument("--num-nodes", type=in_range(1), default=1, help="machines, --devices on each")
    p.add_argument("--strategy", choices=["auto", "ddp", "ddp_spawn"], default="auto",
                   help="auto: DDP for several devices; ddp_spawn: as 04 starts processes")
    p.add_argument("--accelerator", choices=["auto", "cpu", "gpu"], default="auto",
                   help="auto: the GPUs if there are any (--cpu: the CPU, whatever this says)")
    try:
        return p.parse_args(argv)
    except argparse.ArgumentError as e:
        sys.exit(f"error: {e}")  # one line on stderr, exit status 1


def setup(args):
    """The Trainer, once the flags agree with the machine: it starts the processes, gives each its
    device and joins them in a process group (MNISTModule.setup reads where each one is)."""
    per_node, nodes = args.devices, args.num_nodes  # Lightning: unless launched
    if "LOCAL_WORLD_SIZE" in os.environ:  # torchrun
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        nodes = int(os.environ["WORLD_SIZE"]) // per_node
    elif SLURMEnvironment.detect():  # srun, as Lightning detects it
        per_node = int(os.environ.get("SLURM_NTASKS_PER_NODE", per_node))
        nodes = int(os.environ.get("SLURM_NNODES", nodes))
    if (per_node, nodes) != (args.devices, args.num_nodes):
        sys.exit(f"error: the launcher started {per_node} processes on each of {nodes} machines: "
                 f"give --devices {per_node} --num-nodes {nodes}")
    # Lightning: GPUs are CUDA's or MPS's; --cpu forces the CPU, as in 01-06
    accelerator = "cpu" if args.cpu else args.accelerator
    gpus = torch.cuda.device_count() or int(torch.backends.mps.is_available())
    if accelerator != "cpu" and (gpus or accelerator == "gpu") and args.devices > gpus:
        sys.exit(f"error: {args.devices} processes on this machine but {gpus} GPU(s): give fewer "
                 "--devices, or add --cpu to try DDP on the CPU")
    strategy = args.strategy  # Lightning: by name, unless this PyTorch has no NCCL (Windows)
    if args.devices * args.num_nodes > 1 and not dist.is_nccl_available():  # gloo: CUDA too
        start = "spawn" if args.strategy == "ddp_spawn" else "popen"
        strategy = DDPStrategy(start_method=start, process_group_backend="gloo")
    return L.Trainer(
        accelerator=accelerator, devices=args.devices, num_nodes=args.num_nodes,
        strategy=strategy, max_epochs=args.epochs,
        reload_dataloaders_every_n_epochs=1,  # train_dataloader() each epoch: its shuffle
        use_distributed_sampler=False,  # load_data's shares, not Lightning's sampler
        callbacks=[Timed(args)],  # measure
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False)


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
    def training(epoch):
        sampler.set_epoch(epoch)  # a new shuffle every epoch
        order = list(sampler)[:steps * args.batch_size]
        return batches(train_set, order, args.batch_size, args.seed + epoch)
    def testing():
        return batches(test_set, test_rows, args.test_batch_size, args.seed)
    return training, testing


class MNISTModule(L.LightningModule):  # Lightning: 03's loops, as hooks
    """The model, its data and its optimizer, in the hooks the Trainer calls: Lightning writes the
    loops, moves batches, zeroes gradients, calls backward and step, and wraps the model in DDP."""

    def __init__(self, args):
        super().__init__()
        self.args = args

    def prepare_data(self):  # Lightning: in one process per machine, first: 03's barriers
        MNIST(self.args, True, "cpu")  # downloaded, if missing, before the others read it
        MNIST(self.args, False, "cpu")

    # Lightning: in each process, in its group; then the Trainer moves the model to the
    # device and wraps it in DDP
    def setup(self, stage):
        args, trainer = self.args, self.trainer
        if args.threads:
            torch.set_num_threads(args.threads)
        self.world = world = SimpleNamespace(
            device=trainer.strategy.root_device, rank=trainer.global_rank,
            world_size=trainer.world_size, is_main=trainer.is_global_zero)
        world.nodes = trainer.num_nodes  # measure: the record's
        world.mode = "lightning"  # Lightning  # measure
        torch.manual_seed(args.seed + world.rank)  # DDP: its own dropout
        self.train_batches, self.test_batches = load_data(args, world.rank, world.world_size,
                                                          world.device)  # DDP: its share
        self.net = Net(dropout=not args.no_dropout)

    def configure_optimizers(self):
        optimizer = torch.optim.Adadelta(self.parameters(), lr=self.args.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return dict(optimizer=optimizer, lr_scheduler=scheduler)  # stepped once an epoch

    def train_dataloader(self):  # Lightning: at each epoch's start, its full batches
        return self.train_batches(self.current_epoch + 1)  # Lightning counts from 0

    def on_train_epoch_start(self):  # Lightning
        self.loss_sum = torch.zeros((), device=self.world.device)  # float32: MPS has no float64

    def training_step(self, batch, batch_idx):
        inputs, labels = batch  # Lightning moved them to the device
        output = self.net(inputs)
        loss = F.cross_entropy(output, labels)
        self.loss_sum += loss.detach()  # on the device: no waiting for the GPU
        self.steps = batch_idx + 1
        args, epoch = self.args, self.current_epoch + 1  # Lightning counts epochs from 0
        if self.world.is_main and args.log_interval and batch_idx % args.log_interval == 0:
            print(f"epoch {epoch} step {batch_idx} loss {loss.item():.4f}", flush=True)
        return loss  # Lightning calls backward and the optimizer's step

    def val_dataloader(self):  # Lightning: the test set after each epoch's last step
        return self.test_batches()

    # Lightning: in eval() and without gradients, as 03's evaluate(); through DDP, whose first
    # forward after training gives every rank rank 0's buffers (03 broadcasts them itself)
    def on_validation_epoch_start(self):
        self.test_loss_sum, self.correct, self.count = 0.0, 0, 0

    def validation_step(self, batch, batch_idx):
        inputs, labels = batch
        output = self.net(inputs)
        self.test_loss_sum += F.cross_entropy(output, labels, reduction="sum").item()
        self.correct += (output.argmax(dim=1) == labels).sum().item()
        self.count += len(labels)  # counted, not assumed: a lost or repeated row would show

    def on_validation_epoch_end(self):  # Lightning: the end of the epoch
        world, reduce = self.world, self.trainer.strategy.reduce  # Lightning: all_reduce,
        totals = torch.tensor([self.test_loss_sum, self.correct, self.count],
                              device=world.device)  # or nothing on one device (no group)
        loss_sum, correct, count = reduce(totals, reduce_op="sum").tolist()  # DDP
        self.test = dict(test_loss=loss_sum / count, test_accuracy=correct / count,
                         test_samples=int(count))
        loss_sum = reduce(self.loss_sum, reduce_op="sum")  # DDP: all took as many steps
        self.train_loss = loss_sum.item() / self.steps / world.world_size
        if world.is_main:
            print(f"epoch {self.current_epoch + 1}: train loss {self.train_loss:.4f}, accuracy "
                  f"{self.test['test_accuracy']:.2%} of {self.test['test_samples']} test samples",
                  flush=True)

    def on_train_end(self):  # Lightning
        if self.world.is_main and self.args.save_model:
            torch.save(self.net.state_dict(), self.args.save_model)


def lost_peer(e):  # Lightning: trainer.fit raises what its rank met
    """Whether the exception says a peer died or a collective timed out (else it is a bug)."""
    # gloo's errors are plain RuntimeErrors: those of its transport say a peer died ("[.../gloo/
    # transport/tcp/pair.cc:561] Connection closed by peer") or a collective timed out ("[.../gloo/
    # transport/tcp/unbound_buffer.cc:78] Timed out waiting ...", torch 2.14); a shape is no peer
    return (isinstance(e, (dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError,
                           TimeoutError, torch.multiprocessing.ProcessExitedException))  # spawn's
            or isinstance(e, RuntimeError) and "gloo/transport/" in str(e).replace("\\", "/"))


def run(args, trainer):
    # Lightning: each step costs one collective more than 03's: Lightning 2.6 broadcasts
    # rank 0's SIGTERM flag (on GPUs, waiting for it): Lightning-AI/pytorch-lightning#21487.
    try:
        trainer.fit(MNISTModule(args))
    except Exception as e:  # Lightning: a lost peer in one line; anything else: its traceback
        if not lost_peer(e):
            raise
        sys.exit(f"error: rank {trainer.global_rank} lost the others (did one fail first?): "
                 f"{(str(e) or type(e).__name__).splitlines()[0]}")


class Timed(L.Callback):  # Lightning  # measure: timed() and write_record() as hooks
    def __init__(self, args):  # measure
        self.args, self.epochs = args, []  # measure

    def on_train_batch_start(self, trainer, module, batch, step):  # measure
        self.starts = [] if step == 0 else self.starts  # measure: as timed()'s
        if step <= (0 if self.epochs else WARMUP_STEPS):  # measure
            self.starts.append(clock(module.world.device))  # measure

    def on_train_batch_end(self, trainer, module, outputs, batch, step):  # measure
        if step + 1 == trainer.num_training_batches:  # measure: the epoch's last step
            epoch = timing(module.world, self.starts, step + 1, len(batch[1]))  # measure
            self.epochs.append(epoch)  # measure

    def on_train_epoch_end(self, trainer, module):  # measure: after the epoch's evaluation
        self.epochs[-1].update(epoch=trainer.current_epoch + 1, **module.test,  # measure
                               train_loss=module.train_loss)  # measure

    def on_fit_end(self, trainer, module):  # measure
        write_record(self.args.metrics_json, self.args, module.world, self.epochs)  # measure


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
    run(args, setup(args))  # Lightning: it destroys its process group at exit
