"""On PYTHONPATH (test_tensor_parallel.py): each process that calls parallelize_module writes, as it exits, what
its module holds to $RANK_WEIGHTS_DIR/rank<RANK>.pt: {name: (this rank's tensor, its placements)}, a DTensor's
local slice with its placements, a plain tensor with None. A test compares the ranks' copies of what is meant to
be replicated this way, with no line of the script changed and the script started as a user starts it.

With $LOADED_STATE_DIR set (test_fsdp_big.py), 12's resume is read too: right after set_state_dict loads a snapshot,
the whole model and optimizer state, gathered from every rank's shards, goes to $LOADED_STATE_DIR/loaded.pt."""
import atexit
import os
import runpy

# A later sitecustomize on PYTHONPATH runs first (the tests' tests/fast_start): Python itself imports only the first.
_path = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
_here = os.path.dirname(os.path.abspath(__file__))
_later = [p for p in _path[_path.index(_here) + 1 if _here in _path else len(_path):]
          if os.path.isfile(os.path.join(p, "sitecustomize.py"))]
if _later:
    runpy.run_path(os.path.join(_later[0], "sitecustomize.py"), run_name="later_sitecustomize")

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


if os.environ.get("LOADED_STATE_DIR"):
    import torch.distributed.checkpoint.state_dict as state_dicts

    real_set_state_dict = state_dicts.set_state_dict

    def set_state_dict(model, optimizers, **kwargs):
        loaded = real_set_state_dict(model, optimizers, **kwargs)
        whole = state_dicts.StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights, moments = state_dicts.get_state_dict(model, optimizers, options=whole)
        if os.environ["RANK"] == "0":
            torch.save(dict(model=weights, optimizer=moments), os.path.join(os.environ["LOADED_STATE_DIR"], "loaded.pt"))
        return loaded

    state_dicts.set_state_dict = set_state_dict
