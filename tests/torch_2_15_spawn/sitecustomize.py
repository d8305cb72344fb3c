"""torch 2.15's mp.spawn on an older torch: a worker interrupted while its parent lives fails. On PYTHONPATH
(test_reliability.py), in every process of a run.

torch 2.14's worker wrapper, torch.multiprocessing.spawn._wrap, catches KeyboardInterrupt and exits 0, as if the
worker had finished. 2.15's (pytorch/pytorch#194439) exits quietly only when the parent is gone; otherwise it sends
the traceback to the parent, as for any exception, and exits non-zero. With $TORCH_2_15_SPAWN=exit it exits 130
without the traceback instead, so that the parent sees a ProcessExitedException. Each wrapper that runs writes its
pid to $TORCH_2_15_LOG, so that a test knows the hook ran in the workers."""
import importlib.abc
import importlib.machinery
import os
import pickle
import pathlib
import runpy
import signal
import sys
import traceback

# tools/startup_hook.py runs the next sitecustomize.py on PYTHONPATH first: Python imports only the first.
runpy.run_path(str(pathlib.Path(__file__).resolve().parents[2] / "tools" / "startup_hook.py"))["chain"](__file__)

SPAWN = "torch.multiprocessing.spawn"


def wrap(fn, i, args, error_file):
    """2.15's _wrap: 2.14's, but for a KeyboardInterrupt while the parent lives."""
    from torch.multiprocessing import _prctl_pr_set_pdeathsig
    parent = os.getppid()
    _prctl_pr_set_pdeathsig(signal.SIGINT)  # the parent's death: SIGINT here, as in 2.14
    with open(os.environ["TORCH_2_15_LOG"], "a") as log:
        log.write(f"{os.getpid()} wrap {i}\n")
    try:
        fn(i, *args)
    except KeyboardInterrupt:
        if os.getppid() != parent:
            return  # the parent is gone: quietly, as 2.14 always did
        if os.environ.get("TORCH_2_15_SPAWN") != "exit":
            with open(error_file, "wb") as fh:
                pickle.dump(traceback.format_exc(), fh)
        sys.exit(130)
    except Exception:
        with open(error_file, "wb") as fh:
            pickle.dump(traceback.format_exc(), fh)
        sys.exit(1)


class Finder(importlib.abc.MetaPathFinder):
    """Puts wrap in torch.multiprocessing.spawn as it is imported (torch itself imports it)."""

    def find_spec(self, name, path=None, target=None):
        if name != SPAWN:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module._wrap = wrap

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Finder())
