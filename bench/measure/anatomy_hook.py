"""The profiler that bench/anatomy.py runs inside a script's processes, started by tools/copy_hook at start-up.

It does nothing unless ANATOMY_OUT names a folder. Then each process counts its optimizer steps, the edges of
its training steps. Step ANATOMY_SKIP runs under FlopCounterMode, which counts the model's FLOPs. The next
ANATOMY_STEPS steps run under torch.profiler. The process writes trace-rank{r}.json.gz and flops-rank{r}.json.
"""
import json
import os

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.flop_counter import FlopCounterMode

OUT = os.environ["ANATOMY_OUT"]
SKIP = int(os.environ.get("ANATOMY_SKIP", 3))
STEPS = int(os.environ.get("ANATOMY_STEPS", 3))
# The step's edge: every step starts where an optimizer step ends, the first one here.
START_MARK = "anatomy: first step starts"


def activities():
    """The CPU's, and the accelerator's where one is there: its kernels and its copies."""
    kinds = [torch.profiler.ProfilerActivity.CPU]
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is not None and accelerator.type in ("cuda", "xpu"):
        kinds.append(getattr(torch.profiler.ProfilerActivity, accelerator.type.upper()))
    return kinds


def rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


steps_done = 0
flops = FlopCounterMode(display=False)
profiler = torch.profiler.profile(activities=activities(), record_shapes=True)


def after_step(optimizer, args, kwargs):
    global steps_done
    steps_done += 1
    if steps_done == SKIP - 1:
        flops.__enter__()
    elif steps_done == SKIP:
        flops.__exit__(None, None, None)
        profiler.start()
        with torch.profiler.record_function(START_MARK):
            pass
    elif steps_done == SKIP + STEPS:
        profiler.stop()
        profiler.export_chrome_trace(os.path.join(OUT, f"trace-rank{rank()}.json.gz"))
        path = os.path.join(OUT, f"flops-rank{rank()}.json")
        with open(f"{path}.tmp", "w") as f:
            json.dump(dict(rank=rank(), flops_per_step=flops.get_total_flops()), f)
        os.replace(f"{path}.tmp", path)


register_optimizer_step_post_hook(after_step)
