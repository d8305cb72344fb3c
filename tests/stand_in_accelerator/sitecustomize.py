"""An accelerator that is not there: torch reports $STAND_IN_ACCELERATOR ("cuda" or "mps", $STAND_IN_COUNT
devices) as it does on a machine that has one, and every call that would use a real device fails, and is
written to $STAND_IN_LOG. On PYTHONPATH (conftest.with_stand_in_accelerator), in every process of a run; each
process writes its pid and what it runs first, so that a test knows the hook ran in all of them.

play() is also what tests/test_platforms.py's in-process stand_in fixture calls, with monkeypatch's setattr."""
import os
import pathlib
import runpy
import sys

# tools/startup_hook.py runs the next sitecustomize.py on PYTHONPATH first: Python imports only the first.
runpy.run_path(str(pathlib.Path(__file__).resolve().parents[2] / "tools" / "startup_hook.py"))["chain"](__file__)

REPORTS = ["current_accelerator", "is_available", "device_count"]  # what torch.accelerator answers without a device
USES = {"cuda": ["_lazy_init", "set_device", "current_device", "synchronize"],  # all CUDA work starts in _lazy_init
        "mps": ["synchronize", "current_allocated_memory", "driver_allocated_memory", "empty_cache"]}


def play(set_attribute, kind, count=1, used=None):
    """torch answers as on a machine with `count` devices of `kind` (None: none), through torch.accelerator and
    torch._C._get_accelerator (torch's own defaults: a mesh, a barrier), torch.cuda and torch.backends.mps (02 and 07
    count GPUs there). used(name): called for each device call instead of the call (None: the calls are left)."""
    import torch
    device = torch.device(kind) if kind else None
    set_attribute(torch.accelerator, "current_accelerator", lambda check_available=False: device)
    set_attribute(torch.accelerator, "is_available", lambda: device is not None)
    set_attribute(torch.accelerator, "device_count", lambda: count if kind else 0)
    set_attribute(torch._C, "_get_accelerator", lambda: device or torch.device("cpu"))
    set_attribute(torch.cuda, "device_count", lambda: count if kind == "cuda" else 0)
    set_attribute(torch.backends.mps, "is_available", lambda: kind == "mps")
    if kind == "mps":
        set_attribute(torch.mps, "device_count", lambda: count)
    if used is None:
        return
    if kind == "cuda":
        set_attribute(torch.cuda, "is_available", lambda: True)
    calls = [(torch.accelerator, name) for name in dir(torch.accelerator)
             if not name.startswith("_") and name not in REPORTS and callable(getattr(torch.accelerator, name))
             and not isinstance(getattr(torch.accelerator, name), type)]
    calls += [(torch.get_device_module(kind), name) for name in USES.get(kind, [])]
    for module, name in calls:
        set_attribute(module, name, lambda *args, _name=f"{module.__name__}.{name}", **kwargs: used(_name))
    # torch's optimizers ask, at every step() on a CUDA or XPU machine, whether the current stream is capturing a
    # graph (torch/optim/optimizer.py, _accelerator_graph_capture_health_check), CPU parameters or not: no flag
    # of the scripts can spare them that, so it is answered (not capturing) and logged as a query, not a use.
    set_attribute(torch.accelerator, "current_stream", lambda *args, **kwargs: used("current_stream", query=True))


if os.environ.get("STAND_IN_ACCELERATOR"):
    import torchvision  # noqa: F401  (it imports torch._dynamo, which reads what play() replaces: first)

    class NotCapturing:
        def is_capturing(self):
            return False

    def used(name, query=False):
        with open(os.environ["STAND_IN_LOG"], "a") as log:
            log.write(f"{os.getpid()} {'queried' if query else 'used'} {name}\n")
        if query:
            return NotCapturing()
        raise RuntimeError(f"{name}: a device call, on a stand-in accelerator that has no device")

    with open(os.environ["STAND_IN_LOG"], "a") as log:
        log.write(f"{os.getpid()} {os.path.basename(sys.argv[0]) if sys.argv else ''}\n")
    play(setattr, os.environ["STAND_IN_ACCELERATOR"], int(os.environ.get("STAND_IN_COUNT", "1")), used)
