"""The profiler that bench/anatomy.py runs inside a script's processes, started by tools/copy_hook at start-up.

It does nothing unless ANATOMY_OUT names a folder. Then each process counts its optimizer steps, the edges of
its training steps. Steps ANATOMY_SKIP - 2 and - 1 run under a profiler of memory: the second one's peak is
the step's. Step ANATOMY_SKIP runs under FlopCounterMode, which counts the model's FLOPs. The next
ANATOMY_STEPS steps run under torch.profiler. The process writes trace-rank{r}.json.gz and flops-rank{r}.json.
"""
import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.flop_counter import FlopCounterMode

OUT = os.environ["ANATOMY_OUT"]
SKIP = int(os.environ.get("ANATOMY_SKIP", 4))
STEPS = int(os.environ.get("ANATOMY_STEPS", 3))
# The step's edge: every step starts where an optimizer step ends, the first one here.
START_MARK = "anatomy: first step starts"
MEMORY_MARK = "anatomy: the step of the peak starts"


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
# Apart from the others: run together with FlopCounterMode, it crashed 03's processes.
memory = torch.profiler.profile(activities=activities(), profile_memory=True)


def step_peak(watched):
    """The most bytes the second watched step allocated above what was held when it began.

    It is the accelerator's figure where one is used. On the CPU the profiler sees only the frees of blocks
    allocated while it runs, so the first step is watched too: the second one frees what the first made.
    """
    with tempfile.TemporaryDirectory() as folder:
        watched.export_chrome_trace(os.path.join(folder, "memory.json"))
        with open(os.path.join(folder, "memory.json")) as f:
            trace = sorted(json.load(f)["traceEvents"], key=lambda e: e.get("ts", 0))
    begins = next(e["ts"] for e in trace if e.get("name") == MEMORY_MARK)
    events = [e["args"] for e in trace if e.get("name") == "[memory]" and e["ts"] >= begins]
    # Device Type 0 is the CPU's; a CUDA or XPU process also allocates on its device, a higher number.
    device = max(e["Device Type"] for e in events)
    events = [e for e in events if e["Device Type"] == device]
    held = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - held


def after_step(optimizer, args, kwargs):
    global steps_done
    steps_done += 1
    if steps_done == SKIP - 3:
        memory.start()
    elif steps_done == SKIP - 2:
        with torch.profiler.record_function(MEMORY_MARK):
            pass
    elif steps_done == SKIP - 1:
        memory.stop()
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
            json.dump(dict(rank=rank(), flops_per_step=flops.get_total_flops(), step_peak_bytes=step_peak(memory)), f)
        os.replace(f"{path}.tmp", path)


register_optimizer_step_post_hook(after_step)
