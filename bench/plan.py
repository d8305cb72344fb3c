"""What a sweep runs: its settings, every run in order, what it leaves out and why, and a rough duration."""
import dataclasses
import importlib.util
import math
import os

from bench.scripts import REPO, SCRIPTS

# The estimate before a sweep: start-up, data, evaluation, then 01's speed on a 2-core VM or an H200 (results/).
START_S, SAMPLES_PER_S = 10, dict(cpu=1450, gpu=25000)


@dataclasses.dataclass
class Settings:
    """Everything that decides what a run does; stored in env.json so that --resume can check it."""
    gpus: list  # ids as CUDA_VISIBLE_DEVICES names them; [] for a CPU sweep
    max_n: int  # devices at most: len(gpus), or CPU processes
    batches: list  # per-GPU batches B, each swept
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

    def comparable(self):
        """The settings that change results (timeout and target do not): a resumed sweep must match them."""
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
    def run_id(self):  # also its key in runs.csv, for --resume
        variant = "" if self.variant == "base" else f"-{self.variant}"
        return f"{self.mode}-n{self.n}-b{self.batch}-r{self.repeat}{variant}"


def device_counts(max_n):
    """1, the powers of two below max_n, then max_n: 1, 2, 4 for four GPUs; 1, 2, 3 for three."""
    return sorted({1, max_n} | {2 ** k for k in range(1, max_n.bit_length()) if 2 ** k < max_n})


def unavailable_reason(mode):
    """Why a mode cannot run in this checkout and interpreter at all (None when it can)."""
    if not os.path.exists(os.path.join(REPO, SCRIPTS[mode])):
        return "not in this checkout"
    if mode == "lightning" and importlib.util.find_spec("lightning") is None:
        return "lightning cannot be imported by this Python (pip install lightning)"
    return None


def skip_reason(mode, n, cpu):
    """Why a mode is left out at n devices (None when it runs there)."""
    if mode == "single" and n != 1:
        return "01 uses one device"
    if mode == "dp" and cpu and n != 1:
        return "nn.DataParallel has no CPU parallelism: 02 runs as one replica on the CPU"
    if mode == "ddp_multinode" and n % 2:
        return "05 runs as two nodes of n/2 each, so n must be even"
    return None


def plan(settings, modes, variants, repeats):
    """(every run in order, what is left out and why); repeats outermost: a stopped sweep has whole repeats."""
    runnable = [m for m in modes if not unavailable_reason(m)]
    runs = [Run(name, tuple(flags), mode, n, batch, r)
            for r in range(1, repeats + 1) for name, flags in variants for batch in settings.batches
            for n in device_counts(settings.max_n) for mode in runnable if not skip_reason(mode, n, settings.cpu)]
    left_out = [f"{SCRIPTS[m]} ({unavailable_reason(m)})" for m in modes if m not in runnable]
    left_out += [f"{SCRIPTS[m]} at n = {n} ({skip_reason(m, n, settings.cpu)})" for n in device_counts(settings.max_n)
                 for m in runnable if skip_reason(m, n, settings.cpu)]
    return runs, left_out


def estimate_s(run, settings):
    """Rough seconds of one run: MNIST has 60,000 training images."""
    steps = min(math.ceil(60000 / (run.n * run.batch)), settings.max_steps or math.inf)
    speed = SAMPLES_PER_S["cpu"] if settings.cpu else SAMPLES_PER_S["gpu"] * run.n
    return START_S + settings.epochs * steps * run.n * run.batch / speed
