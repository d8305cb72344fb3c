"""On PYTHONPATH (test_tensor_parallel.py): each process that calls parallelize_module writes, as it exits, what
its module holds to $RANK_WEIGHTS_DIR/rank<RANK>.pt: {name: (this rank's tensor, its placements)}, a DTensor's
local slice with its placements, a plain tensor with None. A test compares the ranks' copies of what is meant to
be replicated this way, with no line of the script changed and the script started as a user starts it."""
import atexit
import os
import pathlib
import runpy

# tools/startup_hook.py runs the next sitecustomize.py on PYTHONPATH first: Python imports only the first.
runpy.run_path(str(pathlib.Path(__file__).resolve().parents[3] / "tools" / "startup_hook.py"))["chain"](__file__)

import torch  # noqa: E402
import torch.distributed.tensor.parallel as tensor_parallel  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

real_parallelize_module = tensor_parallel.parallelize_module


def save(module, path):
    held = {name: (t.to_local(), tuple(map(str, t.placements))) if isinstance(t, DTensor) else (t, None)
            for name, t in module.state_dict().items()}
    torch.save({name: (t.detach().cpu().clone(), placements) for name, (t, placements) in held.items()}, path)


def parallelize_module(module, *args, **kwargs):
    parallelized = real_parallelize_module(module, *args, **kwargs)
    path = os.path.join(os.environ["RANK_WEIGHTS_DIR"], f"rank{os.environ['RANK']}.pt")
    atexit.register(save, parallelized, path)  # after the script's last step, as the process ends
    return parallelized


tensor_parallel.parallelize_module = parallelize_module  # before the script's `from ... import` reads it
