"""On PYTHONPATH (test_fsdp_big.py): 12's resume, read as it happens. Right after set_state_dict loads a snapshot,
the whole model and optimizer state, gathered from every rank's shards, goes to $LOADED_STATE_DIR/loaded.pt."""
import os
import pathlib
import runpy

# tools/startup_hook.py runs the next sitecustomize.py on PYTHONPATH first: Python imports only the first.
runpy.run_path(str(pathlib.Path(__file__).resolve().parents[3] / "tools" / "startup_hook.py"))["chain"](__file__)

import torch  # noqa: E402
import torch.distributed.checkpoint.state_dict as state_dicts  # noqa: E402

real_set_state_dict = state_dicts.set_state_dict


def set_state_dict(model, optimizers, **kwargs):
    loaded = real_set_state_dict(model, optimizers, **kwargs)
    whole = state_dicts.StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights, moments = state_dicts.get_state_dict(model, optimizers, options=whole)
    if os.environ["RANK"] == "0":
        torch.save(dict(model=weights, optimizer=moments), os.path.join(os.environ["LOADED_STATE_DIR"], "loaded.pt"))
    return loaded


state_dicts.set_state_dict = set_state_dict  # before 12's `from ... import` reads it
