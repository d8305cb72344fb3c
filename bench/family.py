"""The family of scripts, one row each in reading order: all the harness, tools/ and tests know of a script.
Adding a script is a row here and the script: docs/architecture.md."""
import dataclasses
import importlib.util
import os

from bench import REPO

# Every script's flags, with the same meaning and default (DESIGN.md); a row's flags are its own.
COMMON_FLAGS = ("--data-dir", "--synthetic", "--epochs", "--batch-size", "--test-batch-size", "--lr", "--seed",
                "--max-steps", "--log-interval", "--cpu", "--threads", "--no-dropout", "--metrics-json", "--save-model")


@dataclasses.dataclass(frozen=True)
class Launch:
    """How a kind of script is started; bench/commands.py builds every run's command from this alone."""
    name: str
    torchrun: bool = False  # torchrun starts its n processes; else `python SCRIPT`
    count_flag: str = ""  # the script's own flag for n, where it starts its processes itself
    port_flag: str = ""  # its flag for the port its processes meet at: bench/commands.py gives each run a free one
    group: bool = True  # its processes meet in a process group: the harness checks that collective first
    nodes: int = 1  # started as this many "nodes" on this host, each with n / nodes devices
    flags: object = lambda n, settings: []  # what else a run at n needs (settings: a bench.plan.Settings)


PYTHON = Launch("python", group=False)
DP = Launch("dp", group=False,  # one process drives the GPUs it is given; on the CPU it is one replica
            flags=lambda n, settings: [] if settings.cpu else ["--gpus", ",".join(map(str, range(n)))])
TORCHRUN = Launch("torchrun", torchrun=True)
SPAWN = Launch("spawn", count_flag="--nprocs", port_flag="--master-port")
MULTINODE = Launch("multinode", nodes=2)
LIGHTNING = Launch("lightning", count_flag="--devices",
                   flags=lambda n, settings: ["--strategy", "ddp", "--accelerator", settings.kind])


@dataclasses.dataclass(frozen=True)
class BatchRule:
    """What n devices with a per-device batch B train on (DESIGN.md's batch-size rules)."""
    name: str
    says: str  # the rule in words, for the report
    one_loader: bool = False  # one process loads the whole global batch and splits it across its devices
    shared: bool = False  # every rank trains on the same batch: the global batch is B at every n
    shared_by: int = 1  # groups of this many ranks each train on one batch B: n / shared_by x B in all

    def loader_batch(self, per_device_batch, n):  # the run's --batch-size
        return n * per_device_batch if self.one_loader else per_device_batch

    def global_batch(self, per_device_batch, n):
        return per_device_batch if self.shared else n // self.shared_by * per_device_batch

    @property
    def short(self):  # the global batch at n, as the plots' legends and the summary show it
        return "B" if self.shared else "n x B" if self.shared_by == 1 else f"n/{self.shared_by} x B"


REPLICAS = BatchRule("replicas", "B in each of n processes, n x B in all")
ONE_LOADER = BatchRule("one loader", "--batch-size n x B in one process, split across n GPUs", one_loader=True)
SHARED = BatchRule("shared", "every rank on the same batch B, so B in all at every n", shared=True)
TP_GROUPS = BatchRule("tp groups", "B per dp rank, shared by its 2 tensor-parallel ranks: n / 2 x B in all",
                      shared_by=2)  # 11's TP, its ranks per group


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str  # as its metrics record names it
    script: str
    parent: str  # the script it is a diff of ("" for 01)
    marker: str  # the comment that marks every line it adds to its parent ("# DDP")
    budget: int  # changed lines of `diff -U0 PARENT SCRIPT` at most (None: not held to one)
    max_lines: int
    launch: Launch
    batch: BatchRule = REPLICAS
    flags: tuple = ()  # its own flags, besides COMMON_FLAGS
    runs_with: object = lambda n, cpu: True  # (n, a CPU sweep) -> whether it runs there
    why: str = ""  # why not, for the report
    snapshot: bool = False  # each run gets a --snapshot of its own (deleted after the run)
    needs: str = ""  # a module that must import besides torch
    reference: bool = False  # the sweep's baseline X(01): the 1 of every speed-up and efficiency
    versus_parent: bool = False  # the report sets its rows against its parent's (report_template.md says why)
    limit_note: str = ""  # a block of report_template.md for its rows at n > 1 in the limit model
    sharded: bool = False  # its ranks hold 1/n of the weights: the memory plot's full copy is its run at n = 1
    collectives: str = ""  # what its ranks exchange in a step, for the report

    @property
    def number(self):
        return self.script[:2]

    @property
    def collective(self):  # see Launch.group
        return self.launch.group


MODES = {mode.name: mode for mode in [
    Mode("single", "01_single_gpu.py", "", "", None, 260, PYTHON, reference=True,
         runs_with=lambda n, cpu: n == 1, why="01 uses one device"),
    Mode("dp", "02_data_parallel.py", "01_single_gpu.py", "DP", 40, 320, DP, ONE_LOADER, flags=("--gpus",),
         runs_with=lambda n, cpu: n == 1 or not cpu, limit_note="limit_dp",
         why="nn.DataParallel has no CPU parallelism: 02 runs as one replica on the CPU",
         collectives="scatter of the batch, replicate of the weights, gather of the outputs, reduce of the gradients"),
    Mode("ddp_launch", "03_ddp_launch.py", "01_single_gpu.py", "DDP", 60, 320, TORCHRUN,
         collectives="an all-reduce of the gradients, in buckets, during the backward"),
    Mode("ddp_spawn", "04_ddp_spawn.py", "03_ddp_launch.py", "spawn", 50, 320, SPAWN,
         flags=("--nprocs", "--master-port"), collectives="as 03"),
    Mode("ddp_multinode", "05_multinode_mnist.py", "04_ddp_spawn.py", "multinode", 45, 320, MULTINODE,
         flags=("--nodes", "--gpus", "--node-rank", "--master-addr", "--master-port"),
         runs_with=lambda n, cpu: n % 2 == 0, why="05 runs as two nodes of n/2 each, so n must be even",
         collectives="as 03, across nodes"),
    Mode("ddp_fault_tolerant", "06_fault_tolerant.py", "03_ddp_launch.py", "06", 130, 400, TORCHRUN, snapshot=True,
         flags=("--snapshot", "--snapshot-every", "--timeout"), versus_parent=True, collectives="as 03"),
    Mode("lightning", "07_lightning.py", "03_ddp_launch.py", "Lightning", None, 400, LIGHTNING,
         flags=("--devices", "--num-nodes", "--strategy", "--accelerator"), needs="lightning", versus_parent=True,
         collectives="as 03 (Lightning's DDPStrategy)"),
    Mode("fsdp", "08_fsdp.py", "03_ddp_launch.py", "FSDP", 50, 400, TORCHRUN, sharded=True,
         collectives="an all-gather of each layer's weights before its forward and backward, a reduce-scatter "
                     "of its gradients"),
    Mode("tensor_parallel", "09_tensor_parallel.py", "08_fsdp.py", "TP", 60, 400, TORCHRUN, SHARED,
         runs_with=lambda n, cpu: 128 % n == 0, why="09 splits fc1's 128 outputs evenly, so n must divide 128",
         collectives="one all-reduce of fc2's partial outputs (B x 10) in the forward, one of fc1's input "
                     "gradient (B x 9216) in the backward"),
    Mode("pipeline_parallel", "10_pipeline_parallel.py", "03_ddp_launch.py", "PP", 60, 400, TORCHRUN, SHARED,
         runs_with=lambda n, cpu: n == 2, why="10 has two stages: it runs at n = 2",
         flags=("--microbatches", "--schedule"),
         collectives="a send of each microbatch's activations (B/m x 9216) from stage 0 to stage 1 in the "
                     "forward, one of their gradient back in the backward; a broadcast of the loss"),
    Mode("fsdp_tp", "11_fsdp_tp_mesh.py", "09_tensor_parallel.py", "2D", 60, 400, TORCHRUN, TP_GROUPS,
         runs_with=lambda n, cpu: n % 4 == 0, why="11 needs a 2 x 2 mesh or larger: n a multiple of 4",
         collectives="09's two all-reduces within each pair of tensor-parallel ranks; across the n / 2 pairs "
                     "08's all-gather of each layer's weights and reduce-scatter of its gradients"),
    Mode("fsdp_big", "12_fsdp_big.py", "08_fsdp.py", "12", 130, 400, TORCHRUN, snapshot=True, sharded=True,
         flags=("--snapshot", "--snapshot-every", "--mixed-precision", "--checkpoint-activations"),
         versus_parent=True, collectives="as 08; its snapshots: each rank writes its own shards"),
]}


def by_script(script):  # a script's row, by its file name
    return next(mode for mode in MODES.values() if mode.script == script)


def load_script(name="01_single_gpu.py"):
    """A numbered script as a module (its name starts with a digit, so `import` cannot load it)."""
    spec = importlib.util.spec_from_file_location(f"script_{name[:2]}", os.path.join(REPO, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
