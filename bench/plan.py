"""What a sweep runs: its settings, every run in order, what it leaves out and why, and a rough duration."""
import dataclasses
import importlib.util
import math
import os

from bench.scripts import MODES, REPO

# The estimate before a sweep: start-up, data, evaluation, then 01's speed on a 2-core VM or an H200 (results/).
START_S, SAMPLES_PER_S = 10, dict(cpu=1450, gpu=25000)


@dataclasses.dataclass
class Settings:
    """Everything that decides what a run does; stored in env.json so that --resume can check it."""
    gpus: list  # ids as CUDA_VISIBLE_DEVICES names them; [] for a CPU sweep
    max_n: int  # devices at most: len(gpus), or CPU processes
    per_device_batches: list  # each swept (--per-gpu-batch)
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
    per_device_batch: int
    repeat: int

    @property
    def run_id(self):  # also its key in runs.csv, for --resume
        variant = "" if self.variant == "base" else f"-{self.variant}"
        return f"{self.mode}-n{self.n}-b{self.per_device_batch}-r{self.repeat}{variant}"


def device_counts(max_n):
    """1, the powers of two below max_n, then max_n: 1, 2, 4 for four GPUs; 1, 2, 3 for three."""
    return sorted({1, max_n} | {2 ** k for k in range(1, max_n.bit_length()) if 2 ** k < max_n})


def unavailable_reason(name):
    mode = MODES[name]
    if not os.path.exists(os.path.join(REPO, mode.script)):
        return "not in this checkout"
    if mode.needs and importlib.util.find_spec(mode.needs) is None:
        return f"{mode.needs} cannot be imported by this Python (pip install {mode.needs})"
    return None


def plan(settings, modes, variants, repeats):
    """(every run in order, what is left out and why); repeats outermost: a stopped sweep has whole repeats."""
    runnable, counts = [m for m in modes if not unavailable_reason(m)], device_counts(settings.max_n)
    runs = [Run(name, tuple(flags), mode, n, per_device_batch, r) for r in range(1, repeats + 1)
            for name, flags in variants for per_device_batch in settings.per_device_batches for n in counts
            for mode in runnable if MODES[mode].runs_with(n, settings.cpu)]
    left_out = [f"{MODES[m].script} ({unavailable_reason(m)})" for m in modes if m not in runnable]
    left_out += [f"{MODES[m].script} at n = {n} ({MODES[m].why})" for n in counts for m in runnable
                 if not MODES[m].runs_with(n, settings.cpu)]
    return runs, left_out


def estimate_s(run, settings):
    """Rough seconds of one run: MNIST has 60,000 training images."""
    steps = min(math.ceil(60000 / (run.n * run.per_device_batch)), settings.max_steps or math.inf)
    speed = SAMPLES_PER_S["cpu"] if settings.cpu else SAMPLES_PER_S["gpu"] * run.n
    return START_S + settings.epochs * steps * run.n * run.per_device_batch / speed
