"""What tools/check_copy.py learns from a script while it runs, without any of the script's own measurement.

Python imports this file at start-up when tools/copy_hook is on PYTHONPATH (the checker puts it there); it does
nothing unless CHECK_COPY_OUT names a folder. Then each process records, and writes there as a JSON file when it
exits (DataLoader workers, forks of it, write nothing):

- every order a DistributedSampler hands out, in the order asked for (its rank, world size, epoch, shuffle, the
  dataset's length, the indices);
- the rows scored: the first dimension of the output of each outermost forward pass made in eval() without
  gradients (a wrapper still in train mode around it, as Lightning's DDP is in validation, does not count);
- every file it writes (open() and Path.open() for writing, torch.save to a path or a file, os.replace,
  os.rename), with its rank;
- with CHECK_COPY_KILL_AT=N, the process of rank CHECK_COPY_KILL_RANK kills itself (SIGKILL) at its Nth training
  forward pass (outermost, in train mode, with gradients) of torchrun's first attempt, as a failing machine would,
  if it has written CHECK_COPY_SNAPSHOT by then; first it writes killed-PID.json. Forward passes in DataLoader
  workers (a transform that is an nn.Module) are not training steps: only the process itself counts.

With ANATOMY_OUT set instead, it runs bench/measure/anatomy_hook.py, the profiler of bench/anatomy.py: one start-up
hook for both tools.
"""
import atexit
import builtins
import io
import json
import os
import pathlib
import runpy
import signal

# tools/startup_hook.py runs the next sitecustomize.py on PYTHONPATH first: Python imports only the first.
_repo = pathlib.Path(__file__).resolve().parents[2]
runpy.run_path(str(_repo / "tools" / "startup_hook.py"))["chain"](__file__)

OUT = os.environ.get("CHECK_COPY_OUT")


def _install():
    import torch
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    record = dict(samplers=[], eval_rows=0, train_forwards=0, writes=[],
                  restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    parent = os.getpid()
    kill_at = int(os.environ.get("CHECK_COPY_KILL_AT", 0))
    kill_rank = int(os.environ.get("CHECK_COPY_KILL_RANK", 1))
    snapshot = os.path.abspath(os.environ.get("CHECK_COPY_SNAPSHOT", os.devnull))

    def rank():
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))

    real_iter = DistributedSampler.__iter__

    def recording_iter(sampler):
        order = list(real_iter(sampler))
        record["samplers"].append(dict(rank=sampler.rank, replicas=sampler.num_replicas, epoch=sampler.epoch,
                                       shuffle=sampler.shuffle, length=len(sampler.dataset), indices=order))
        return iter(order)

    DistributedSampler.__iter__ = recording_iter

    stack = []  # [module, rows of its output] of the forward passes under way, outermost first

    def pre(module, args):
        if not stack and module.training and torch.is_grad_enabled() and os.getpid() == parent:
            record["train_forwards"] += 1
            if record["train_forwards"] == kill_at and rank() == kill_rank and record["restart"] == "0":
                if any(w["path"] == snapshot for w in record["writes"]):  # a snapshot to resume from
                    with real_open(os.path.join(OUT, f"killed-{os.getpid()}.json"), "w") as f:
                        json.dump(record, f)
                    os.kill(os.getpid(), signal.SIGKILL)
        stack.append([module, 0])

    def post(module, args, output):
        _, rows = stack.pop()
        first = next((t for t in (output if isinstance(output, (tuple, list)) else [output])
                      if isinstance(t, torch.Tensor) and t.dim()), None)
        rows = first.shape[0] if first is not None else rows
        scoring = not module.training and not torch.is_grad_enabled()
        if scoring and all(m.training for m, _ in stack):  # the outermost module in eval()
            record["eval_rows"] += rows
        elif stack:
            stack[-1][1] = max(stack[-1][1], rows)

    torch.nn.modules.module.register_module_forward_pre_hook(pre)
    torch.nn.modules.module.register_module_forward_hook(post)

    def wrote(path):
        path = os.path.abspath(os.fspath(path))
        if not path.startswith(os.path.abspath(OUT)):
            record["writes"].append(dict(rank=rank(), path=path))

    real_open, real_save, real_replace, real_rename = builtins.open, torch.save, os.replace, os.rename

    def recording_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") \
                and not os.path.isdir(file):  # a folder: tempfile's unnamed file in it (O_TMPFILE), no file
            wrote(file)
        return real_open(file, mode, *args, **kwargs)

    def recording_save(obj, f, *args, **kwargs):
        path = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)  # a path, or a file's
        if isinstance(path, (str, os.PathLike)):
            wrote(path)
        return real_save(obj, f, *args, **kwargs)

    def recording_replace(src, dst, *args, **kwargs):
        wrote(dst)
        return real_replace(src, dst, *args, **kwargs)

    def recording_rename(src, dst, *args, **kwargs):
        wrote(dst)
        return real_rename(src, dst, *args, **kwargs)

    builtins.open, torch.save, os.replace, os.rename = recording_open, recording_save, recording_replace, \
        recording_rename
    io.open = recording_open  # pathlib.Path.open calls io.open, not builtins.open

    @atexit.register
    def dump():
        if os.getpid() == parent:
            with real_open(os.path.join(OUT, f"{os.getpid()}.json"), "w") as f:
                json.dump(record, f)


if OUT:
    _install()

# bench/anatomy.py measures a script's steps through this same hook.
if os.environ.get("ANATOMY_OUT"):
    runpy.run_path(str(_repo / "bench" / "measure" / "anatomy_hook.py"), run_name="anatomy_hook")
