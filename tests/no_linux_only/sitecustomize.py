"""On PYTHONPATH (conftest.without_linux_only): code under $HIDDEN_FROM (outside site-packages) cannot import fcntl
or resource, as on Windows, and no process has os.sched_getaffinity (macOS and Windows have none). Each process
writes its pid and what it runs (the script, or -c and -m as Python's sys.argv has them) to $HIDDEN_LOG, so that
a test knows the hook ran in every process."""
import builtins
import importlib.abc
import os
import pathlib
import runpy
import sys

# tools/startup_hook.py runs the next sitecustomize.py on PYTHONPATH first: Python imports only the first.
runpy.run_path(str(pathlib.Path(__file__).resolve().parents[2] / "tools" / "startup_hook.py"))["chain"](__file__)

ROOT = os.path.abspath(os.environ["HIDDEN_FROM"])
with open(os.environ["HIDDEN_LOG"], "a") as log:
    log.write(f"{os.getpid()} {os.path.basename(sys.argv[0]) if sys.argv else ''}\n")

LINUX_ONLY = ("fcntl", "resource")


def refuse(name, filename):
    path = os.path.abspath(filename or "")
    if path.startswith(ROOT + os.sep) and "site-packages" not in path:
        raise ModuleNotFoundError(f"No module named {name!r} (as on Windows): imported by {path}", name=name)


def import_(name, globals=None, locals=None, fromlist=(), level=0, real=builtins.__import__):
    if level == 0 and name.partition(".")[0] in LINUX_ONLY:  # a statement, even of a module torch loaded already
        refuse(name, (globals or {}).get("__file__"))
    return real(name, globals, locals, fromlist, level)


class Finder(importlib.abc.MetaPathFinder):  # importlib.import_module(name) of a module not loaded yet
    def find_spec(self, name, path=None, target=None):
        frame = sys._getframe(1) if name in LINUX_ONLY else None
        while frame and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
            frame = frame.f_back
        if frame:
            refuse(name, frame.f_globals.get("__file__"))
        return None


builtins.__import__ = import_
sys.meta_path.insert(0, Finder())
del os.sched_getaffinity
