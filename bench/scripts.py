"""The one table of modes (as metrics records name them) in reading order, for bench/ and the tests; load_script."""
import dataclasses
import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    script: str
    launch: str  # python, dp (one process, --gpus 0,..,n-1), torchrun, spawn, multinode (two "nodes"), lightning
    runs_with: object = lambda n, cpu: True  # (n, a CPU sweep) -> whether it runs there; why not, for the report:
    why: str = ""
    snapshot: bool = False  # each run gets a --snapshot of its own (deleted after the run)
    needs: str = ""  # a module that must import besides torch

    @property
    def collective(self):
        """Whether its processes meet in a process group: they need the collective the harness checks first."""
        return self.launch not in ("python", "dp")

    def loader_batch(self, per_device_batch, n):
        """Its --batch-size; the global batch is n x per_device_batch, and dp's one process loads all of it."""
        return n * per_device_batch if self.launch == "dp" else per_device_batch


MODES = {mode.name: mode for mode in [
    Mode("single", "01_single_gpu.py", "python", runs_with=lambda n, cpu: n == 1, why="01 uses one device"),
    Mode("dp", "02_data_parallel.py", "dp", runs_with=lambda n, cpu: n == 1 or not cpu,
         why="nn.DataParallel has no CPU parallelism: 02 runs as one replica on the CPU"),
    Mode("ddp_launch", "03_ddp_launch.py", "torchrun"),
    Mode("ddp_spawn", "04_ddp_spawn.py", "spawn"),
    Mode("ddp_multinode", "05_multinode_mnist.py", "multinode", runs_with=lambda n, cpu: n % 2 == 0,
         why="05 runs as two nodes of n/2 each, so n must be even"),
    Mode("ddp_fault_tolerant", "06_fault_tolerant.py", "torchrun", snapshot=True),
    Mode("lightning", "07_lightning.py", "lightning", needs="lightning"),
    Mode("fsdp", "08_fsdp.py", "torchrun"),  # left out, saying so, while the checkout has no 08
    Mode("tensor_parallel", "09_tensor_parallel.py", "torchrun"),
]}


def load_script(name="01_single_gpu.py"):
    """A numbered script as a module (its name starts with a digit, so `import` cannot load it)."""
    spec = importlib.util.spec_from_file_location(f"script_{name[:2]}", os.path.join(REPO, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
