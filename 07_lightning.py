"""MNIST as a LightningModule and a Trainer: 01-05's training, with Lightning writing the loops.

    python 07_lightning.py                                     # 01: one device
    python 07_lightning.py --devices 2                         # 03: Lightning starts 2 processes
    python 07_lightning.py --devices 2 --strategy ddp_spawn    # 04: torch.multiprocessing.spawn
    torchrun --standalone --nproc_per_node 2 07_lightning.py --devices 2     # 03 under torchrun
    torchrun --nnodes 2 --nproc_per_node 4 --node_rank R --master_addr HOST --master_port PORT \\
        07_lightning.py --devices 4 --num-nodes 2              # 05: on each of 2 machines
    MASTER_ADDR=HOST MASTER_PORT=PORT NODE_RANK=R python 07_lightning.py --devices 4 --num-nodes 2
    srun --nodes 2 --ntasks-per-node 4 python 07_lightning.py --devices 4 --num-nodes 2   # SLURM
    python 07_lightning.py --devices 2 --synthetic --max-steps 100   # random data, throughput only

02 has no equivalent: Lightning 2 removed strategy="dp" (use DDP). Under torchrun or SLURM,
--devices and --num-nodes must match the processes the launcher starts (checked before any work).
A LightningModule is an nn.Module (a subclass, not a superclass), and its hooks are Lightning 2's:
train_dataloader (once tng_dataloader), configure_optimizers, on_validation_epoch_end (once
validation_end); metrics go to a Callback or self.log (once update_tng_log_metrics).
"""
import argparse
import fcntl
import json
import logging
import math
import os
import resource
import sys
import time
import warnings

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.utilities import disable_possible_user_warnings
from torch.utils.data import DistributedSampler
from torchvision import datasets

MODE = "lightning"
WARMUP_STEPS = 5  # left out of samples_per_s: first steps pay for allocation and kernel selection
POSITIVE = ["epochs", "batch_size", "test_batch_size", "lr", "devices", "num_nodes"]
NOT_NEGATIVE = ["max_steps", "log_interval", "threads"]  # values >= 0
STRATEGIES = ["auto", "ddp", "ddp_spawn"]  # auto: one device alone, ddp for several
ACCELERATORS = ["auto", "cpu", "gpu"]  # auto: the GPUs if there are any

# Output like 01-05's: no "GPU available" lines, no advice on workers. At import, so that the
# processes ddp_spawn starts (they import this file, they do not run main) are quiet too.
for name in ["lightning.pytorch", "lightning.fabric"]:
    logging.getLogger(name).setLevel(logging.WARNING)
disable_possible_user_warnings()
warnings.filterwarnings("ignore", ".*LeafSpec.*", FutureWarning)  # torch is newer than Lightning

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
    p.add_argument("--devices", type=int, default=1, help="processes per node (GPUs or CPU shares)")
    p.add_argument("--num-nodes", type=int, default=1, help="machines, --devices processes on each")
    p.add_argument("--strategy", default="auto", help="auto, ddp or ddp_spawn")
    p.add_argument("--accelerator", default="auto", help="auto, cpu (as --cpu) or gpu")
    args = p.parse_args(argv)
    for name in POSITIVE + NOT_NEGATIVE:
        value = getattr(args, name)
        if not (0 < value < math.inf if name in POSITIVE else 0 <= value < math.inf):  # NaN too
            kind = "positive" if name in POSITIVE else "zero or more"
            fail(f"--{name.replace('_', '-')} must be {kind}, got {value}")
    if not 0 <= args.seed < 2**32:
        fail(f"--seed must be in 0..2**32-1, got {args.seed}")
    for path in filter(None, [args.metrics_json, args.save_model]):  # each written into its folder
        if os.path.isdir(path) or not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            fail(f"cannot write {path}: its folder does not exist or is not writable")
    return args

def check_launch(args):
    """Lightning's flags, checked here: the Trainer would stop with a traceback, or later."""
    if args.strategy not in STRATEGIES:
        fail(f"--strategy must be {' or '.join(STRATEGIES)}, got {args.strategy}")
    if args.accelerator not in ACCELERATORS:
        fail(f"--accelerator must be {' or '.join(ACCELERATORS)}, got {args.accelerator}")
    gpus = 0 if args.cpu else torch.cuda.device_count()
    wants_gpus = args.accelerator == "gpu" or (args.accelerator == "auto" and gpus > 0)
    if wants_gpus and args.devices > gpus:
        fail(f"--devices {args.devices} needs {args.devices} GPUs, {gpus} can be seen "
             "(--cpu uses none)")
    launched = launcher_world()
    if launched and launched != (args.devices, args.num_nodes):
        fail(f"the launcher started {launched[0]} processes on each of {launched[1]} nodes: "
             f"give --devices {launched[0]} --num-nodes {launched[1]}")

def launcher_world():
    """(processes per node, nodes) when torchrun or srun started this process, else None."""
    if "LOCAL_WORLD_SIZE" in os.environ:  # torchrun
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        return per_node, int(os.environ["WORLD_SIZE"]) // per_node
    slurm_batch = os.environ.get("SLURM_JOB_NAME") not in ["bash", "interactive"]
    if "SLURM_NTASKS_PER_NODE" in os.environ and slurm_batch:  # as Lightning detects SLURM
        per_node = int(os.environ["SLURM_NTASKS_PER_NODE"])
        return per_node, int(os.environ.get("SLURM_NNODES", 1))
    return None

def setup(trainer, args):
    """The one place that decides rank, world size and device: here the Trainer has, we read it."""
    devices = [trainer.strategy.root_device]
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // trainer.num_devices)
    torch.set_num_threads(threads)  # processes on one machine share its cores
    return dict(rank=trainer.global_rank, world_size=trainer.world_size, nodes=trainer.num_nodes,
                backend=dist.get_backend() if dist.is_initialized() else None,
                master=trainer.is_global_zero, local_rank=trainer.local_rank,
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

class Batches:
    """batches() as Lightning wants a loader: a length, and a new pass each epoch. Training leaves
    out the short last batch (drop_last: one shape for every step), as 01-05 do."""
    def __init__(self, data, indices, batch_size, drop_last):
        self.data, self.indices = data, indices
        self.batch_size, self.drop_last = batch_size, drop_last

    def __len__(self):
        whole, rest = divmod(len(self.indices), self.batch_size)
        return whole if self.drop_last or rest == 0 else whole + 1

    def __iter__(self):
        # A generator: the sampler's order is read at the first batch, after on_train_epoch_start
        # has set the epoch (Lightning asks for the iterator of the first epoch before that hook).
        order = list(self.indices)[:len(self) * self.batch_size]
        yield from batches(self.data, order, self.batch_size)

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
    if dist.is_initialized():  # Lightning starts no process group for one device
        dist.all_reduce(tensor, op=op)
    return tensor.item()

class MNISTModule(L.LightningModule):
    """The model, its data and its optimizer, in the hooks the Trainer calls: Lightning writes the
    loops, moves batches, zeroes gradients, calls backward and step, and wraps the model in DDP."""
    def __init__(self, args):
        super().__init__()
        self.args = args

    def prepare_data(self):
        # Lightning calls this in one process per node while the others wait: 03's barriers.
        if not self.args.synthetic:
            load_mnist(self.args, train=True)
            load_mnist(self.args, train=False)

    def setup(self, stage):
        # In every process, once the Trainer has started it and joined the process group.
        # Then the Trainer moves the model to the device and wraps it in DDP.
        self.ctx = setup(self.trainer, self.args)
        device = self.ctx["device"]
        torch.manual_seed(self.args.seed + self.ctx["rank"])  # its own dropout; DDP copies rank 0's
        self.train_data = [t.to(device) for t in load_mnist(self.args, train=True)]
        self.test_data = [t.to(device) for t in load_mnist(self.args, train=False)]
        self.net = Net(dropout=not self.args.no_dropout)

    def train_dataloader(self):
        # Our sampler, not Lightning's (Trainer(use_distributed_sampler=False)): Lightning's would
        # shuffle with another seed and count epochs from 0, so the order would not be 01's.
        train_size = len(self.train_data[1])
        world_size, rank = self.ctx["world_size"], self.ctx["rank"]
        self.sampler = DistributedSampler(range(train_size), world_size, rank, seed=self.args.seed)
        if len(self.sampler) < self.args.batch_size:
            fail(f"--batch-size {self.args.batch_size} is more than the {len(self.sampler)} "
                 "training images")
        return Batches(self.train_data, self.sampler, self.args.batch_size, drop_last=True)

    def val_dataloader(self):
        # Each rank tests every world_size-th image: all of them exactly once. Lightning's sampler
        # would pad the ranks' shares with repeated images (10,002 of them at world size 3).
        test_size = len(self.test_data[1])
        test_indices = range(self.ctx["rank"], test_size, self.ctx["world_size"])
        return Batches(self.test_data, test_indices, self.args.test_batch_size, drop_last=False)

    def configure_optimizers(self):
        optimizer = torch.optim.Adadelta(self.parameters(), lr=self.args.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return dict(optimizer=optimizer, lr_scheduler=scheduler)  # stepped once an epoch

    def on_train_epoch_start(self):
        self.sampler.set_epoch(self.current_epoch + 1)  # 01-05 count from 1, Lightning from 0

    def training_step(self, batch, batch_idx):
        images, labels = batch  # already on the device
        output = self.net(images)
        loss = F.cross_entropy(output, labels)
        return loss  # Lightning calls backward and the optimizer's step

    def on_validation_epoch_start(self):
        self.loss_sum, self.correct, self.count = 0.0, 0, 0

    def validation_step(self, batch, batch_idx):
        images, labels = batch  # Lightning has called eval() and turned off gradients
        output = self.net(images)
        self.loss_sum += F.cross_entropy(output, labels, reduction="sum").item()
        self.correct += (output.argmax(dim=1) == labels).sum().item()
        self.count += len(labels)

    def on_validation_epoch_end(self):
        device = self.ctx["device"]
        loss_sum = all_ranks(self.loss_sum, device)  # totals over all ranks: each image once
        correct = all_ranks(self.correct, device)
        count = all_ranks(self.count, device)
        self.test = dict(test_loss=loss_sum / count, test_accuracy=correct / count,
                         test_samples=int(count))

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

class Metrics(L.Callback):
    """03's clocks, sums, epoch lines and metrics record, outside the model as Lightning intends:
    train_epoch's measuring, cut into the hooks around each step and epoch."""
    def __init__(self, args):
        self.args, self.epochs = args, []

    def on_train_epoch_start(self, trainer, module):
        device = module.ctx["device"]
        self.steps = trainer.num_training_batches  # --max-steps: Trainer(limit_train_batches)
        self.warmup = min(WARMUP_STEPS, self.steps - 1) if trainer.current_epoch == 0 else 0
        self.lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        if device.type == "cuda":  # the peak of training, not of loading the data
            torch.cuda.reset_peak_memory_stats(device)
        self.start = self.steady_start = clock(device)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == self.warmup:
            self.steady_start = clock(module.ctx["device"])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        images, labels = batch
        loss = outputs["loss"]  # detached by Lightning
        self.loss_sum += loss * len(labels)  # summed on the device: no waiting for the GPU
        epoch = trainer.current_epoch + 1
        if trainer.is_global_zero and self.args.log_interval:
            if batch_idx % self.args.log_interval == 0:
                print(f"epoch {epoch} step {batch_idx}/{self.steps} loss {loss.item():.4f}",
                      flush=True)
        if batch_idx + 1 == self.steps:  # the end of training; Lightning evaluates next
            self.end = clock(module.ctx["device"])
            self.memory = peak_memory_bytes(module.ctx["device"])

    def on_train_epoch_end(self, trainer, module):
        # After Lightning's validation loop: module.test holds this epoch's evaluation.
        device, args, epoch = module.ctx["device"], self.args, trainer.current_epoch + 1
        loss_sum = all_ranks(self.loss_sum, device)  # totals over all ranks
        samples = int(all_ranks(self.steps * args.batch_size, device))
        steady_samples = int(all_ranks((self.steps - self.warmup) * args.batch_size, device))
        time_s = all_ranks(self.end - self.start, device, dist.ReduceOp.MAX)  # the slowest rank
        steady_time_s = all_ranks(self.end - self.steady_start, device, dist.ReduceOp.MAX)
        memory = [int(all_ranks(self.memory, device, dist.ReduceOp.MAX))]
        train = dict(steps=self.steps, train_samples=samples, steady_samples=steady_samples,
                     train_loss=loss_sum / samples, train_time_s=time_s,
                     steady_time_s=steady_time_s, peak_memory_bytes=max(memory),
                     peak_memory_per_device=memory)
        test = module.test
        self.epochs.append(dict(epoch=epoch, lr=self.lr, **train, **test))
        if trainer.is_global_zero:
            print(f"epoch {epoch}: train loss {train['train_loss']:.4f}, accuracy "
                  f"{test['test_accuracy']:.2%} of {test['test_samples']} test images", flush=True)

    def on_train_end(self, trainer, module):
        args, ctx = self.args, module.ctx
        record = metrics_record(args, ctx, self.epochs)
        if ctx["master"]:
            note = " (synthetic data: the accuracy means nothing)" if args.synthetic else ""
            print(f"{MODE}: {record['samples_per_s']:.0f} samples/s, world size "
                  f"{ctx['world_size']}, {ctx['device']}{note}")
            if args.save_model:
                torch.save(module.net.state_dict(), args.save_model)
            if args.metrics_json:  # whole or not at all: renamed once written
                with open(f"{args.metrics_json}.tmp", "w") as f:
                    json.dump(record, f, indent=2)
                os.replace(f"{args.metrics_json}.tmp", args.metrics_json)

def main(argv=None):
    args = parse_args(argv)
    check_launch(args)
    module = MNISTModule(args)
    trainer = L.Trainer(
        accelerator="cpu" if args.cpu else args.accelerator, devices=args.devices,
        num_nodes=args.num_nodes, strategy=args.strategy,
        max_epochs=args.epochs,
        limit_train_batches=args.max_steps or None,  # per epoch (Trainer(max_steps): in all)
        use_distributed_sampler=False,  # our samplers: 01's order, and no padded test images
        callbacks=[Metrics(args)], num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    # Each step of several processes costs one collective more than 03's: Lightning 2.6 broadcasts
    # rank 0's SIGTERM flag (on GPUs, waiting for it): Lightning-AI/pytorch-lightning#21487.
    try:
        trainer.fit(module)
    except RuntimeError as e:  # a peer died (gloo: RuntimeError; NCCL: DistError, a subclass)
        fail(f"rank {trainer.global_rank} stopped (did another fail first?): "
             f"{(str(e) or type(e).__name__).splitlines()[0]}")

if __name__ == "__main__":
    main()
