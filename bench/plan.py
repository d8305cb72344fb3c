"""What a sweep runs: its settings, every run in order, the combinations it leaves out and why, and a rough
estimate of how long it takes."""
import dataclasses
import importlib.util
import math
import os

from bench.scripts import MODES, REPO, SCRIPTS

MNIST_TRAIN_IMAGES = 60000
# The estimate printed before a sweep: start-up, data and evaluation per run, then training at the speed
# of 01 on a 2-core VM or one H200 (results/); rough, but it tells minutes from hours.
START_S, SAMPLES_PER_S = 10, dict(cpu=1450, gpu=25000)


@dataclasses.dataclass
class Settings:
    """Everything that decides what a run does; stored in env.json so that --resume can check it."""
    gpus: list  # ids as CUDA_VISIBLE_DEVICES names them; [] for a CPU sweep
    cpu_processes: int
    batches: list  # per-GPU batches B, each a sweep of its own
    epochs: int
    max_steps: int
    test_batch_size: int
    seed: int
    synthetic: bool
    data_dir: str
    target_acc: float
    timeout: float
    cores: int  # CPU runs share them: each of n processes gets cores // n threads

    @property
    def cpu(self):
        return not self.gpus

    @property
    def max_n(self):
        return self.cpu_processes if self.cpu else len(self.gpus)

    def comparable(self):
        """The settings that change results: a resumed sweep must match them (timeout and target do not)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("timeout", "target_acc")}


@dataclasses.dataclass(frozen=True)
class Run:
    variant: str
    flags: tuple  # the variant's script flags
    mode: str
    n: int
    batch: int
    repeat: int

    @property
    def key(self):
        return (self.variant, self.mode, self.n, self.batch, self.repeat)

    @property
    def run_id(self):
        return f"{self.mode}-n{self.n}-b{self.batch}-r{self.repeat}" + ("" if self.variant == "base" else f"-{self.variant}")


def device_counts(max_n):
    """1, the powers of two below max_n, then max_n: 1, 2, 4 for four GPUs; 1, 2, 3 for three."""
    return sorted({1, max_n} | {2 ** k for k in range(1, max_n.bit_length()) if 2 ** k < max_n})


def unavailable(mode):
    """Why a mode cannot run on this checkout or interpreter at all (None when it can)."""
    if not os.path.exists(os.path.join(REPO, SCRIPTS[mode])):
        return f"{SCRIPTS[mode]} is not in this checkout"
    if mode == "lightning" and importlib.util.find_spec("lightning") is None:
        return "lightning cannot be imported by this Python (pip install lightning)"
    return None


def skip_reason(mode, n, cpu):
    """Why a mode is left out at n devices (None when it runs there)."""
    if mode == "single" and n != 1:
        return "01 uses one device"
    if mode == "dp" and cpu and n != 1:
        return "nn.DataParallel has no CPU parallelism (02 runs as one replica on the CPU)"
    if mode == "ddp_multinode" and n % 2:
        return "05 runs as two nodes of n/2 each, so n must be even"
    return None


def plan(settings, modes, variants, repeats):
    """Every run, repeats outermost so that a sweep stopped early still has whole repeats."""
    return [Run(name, tuple(flags), mode, n, batch, r)
            for r in range(1, repeats + 1) for name, flags in variants for batch in settings.batches
            for n in device_counts(settings.max_n) for mode in modes if skip_reason(mode, n, settings.cpu) is None]


def left_out(settings, modes):
    """(mode, n or None for every n, reason) of what the sweep leaves out, for the report."""
    return [(m, n, skip_reason(m, n, settings.cpu)) for n in device_counts(settings.max_n) for m in modes
            if skip_reason(m, n, settings.cpu)]


def estimate_s(run, settings):
    """Rough seconds of one run."""
    global_batch = run.n * run.batch
    steps = math.ceil(MNIST_TRAIN_IMAGES / global_batch)
    steps = min(steps, settings.max_steps) if settings.max_steps else steps
    speed = SAMPLES_PER_S["cpu"] if settings.cpu else SAMPLES_PER_S["gpu"] * run.n
    return START_S + settings.epochs * steps * global_batch / speed
