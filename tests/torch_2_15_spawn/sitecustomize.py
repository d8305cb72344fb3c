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
import runpy
import signal
import sys
import traceback

# A later sitecustomize on PYTHONPATH runs first (the tests' tests/fast_start): Python itself imports only the first.
_path = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
_here = os.path.dirname(os.path.abspath(__file__))
_later = [p for p in _path[_path.index(_here) + 1 if _here in _path else len(_path):]
          if os.path.isfile(os.path.join(p, "sitecustomize.py"))]
if _later:
    runpy.run_path(os.path.join(_later[0], "sitecustomize.py"), run_name="later_sitecustomize")

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
