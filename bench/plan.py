"""What a sweep runs: its settings, every run in order, what it leaves out and why, and a rough duration."""
import dataclasses
import importlib.util
import math
import os

from bench.family import MODES, REPO

# The estimate before a sweep: start-up, one evaluation of 10,000 images per epoch, training at 01's speed.
START_S, EVAL_S, SAMPLES_PER_S = dict(cpu=18, gpu=10), dict(cpu=4, gpu=0.2), dict(cpu=850, gpu=25000)
ESTIMATED_ON = dict(cpu="a quiet 2-core VM", gpu="an H200")  # where those were measured (their sweeps in results/)
TIMEOUT_FACTOR, TIMEOUT_SLACK_S = 5, 120  # a run's bound: 5 x its estimate + 2 minutes (CUDA start-up, imports)


@dataclasses.dataclass
class Settings:
    """Everything that decides what a run does; stored in env.json so that --resume can check it."""
    gpus: list  # ids as CUDA_VISIBLE_DEVICES names them; [] for a CPU sweep
    max_n: int  # devices at most: len(gpus), or CPU processes
    per_device_batches: list  # each swept (--per-gpu-batch)
    epochs: int
    epoch_images: int  # training images per epoch, the same at every n (0: all of MNIST's)
    test_batch_size: int
    seed: int
    synthetic: bool
    data_dir: str
    target_acc: float
    timeout: float  # seconds a run may take; None: from its estimate (timeout_s)
    cores: int  # CPU runs share them: each of n processes gets cores // n threads

    @property
    def cpu(self):
        return not self.gpus

    @property
    def kind(self):  # the estimate's keys, and Lightning's --accelerator
        return "cpu" if self.cpu else "gpu"

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
    runnable = [m for m in modes if not unavailable_reason(m)]
    left_out, where = [f"{MODES[m].script} ({unavailable_reason(m)})" for m in modes if m not in runnable], []
    for n, mode in [(n, MODES[m]) for n in device_counts(settings.max_n) for m in runnable]:
        if not mode.runs_with(n, settings.cpu):
            left_out.append(f"{mode.script} at n = {n} ({mode.why})")
        elif settings.cpu and n == 1 < settings.max_n and mode.collective:  # on 01's cores: only the wrapper's cost
            left_out.append(f"{mode.script} at n = 1 (a CPU sweep to n > 1 runs the process-group modes at n > 1 "
                            "only, to stay short; --cpu 1 runs them)")
        else:
            where.append((mode.name, n))
    return [Run(name, tuple(flags), mode, n, batch, r) for r in range(1, repeats + 1) for name, flags in variants
            for batch in settings.per_device_batches for mode, n in where], left_out


def ideal_speedup(n, shared_cores):
    """The most n devices can do over 01: n GPUs n x 01; n processes on the cores 01 had alone, 1 x 01."""
    return 1 if shared_cores else n


def global_batch(run):
    return MODES[run.mode].batch.global_batch(run.per_device_batch, run.n)


def steps_per_epoch(run, settings):
    """The run's --max-steps (0: all): epoch_images over its global batch, rounded up: the same images at every n."""
    return math.ceil(settings.epoch_images / global_batch(run))


def estimate_s(run, settings):
    """Rough seconds of one run: MNIST has 60,000 training images."""
    steps = min(math.ceil(60000 / global_batch(run)), steps_per_epoch(run, settings) or math.inf)
    speed = SAMPLES_PER_S[settings.kind] * ideal_speedup(run.n, settings.cpu)
    return START_S[settings.kind] + settings.epochs * (EVAL_S[settings.kind] + steps * global_batch(run) / speed)


def timeout_s(run, settings):
    """--timeout, else a bound from the estimate: a hung collective ends in minutes, not after NCCL's 10."""
    return settings.timeout or TIMEOUT_FACTOR * estimate_s(run, settings) + TIMEOUT_SLACK_S
