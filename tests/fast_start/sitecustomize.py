"""Every Python the tests start runs this first: conftest.py puts it last on PYTHONPATH, and the other hooks there
run it before their own code. It changes no line a script runs, only when Python's garbage collector looks.

Importing torch and torchvision makes about a million objects, and they live until the process ends. The
collector walks them again and again: while they are imported, and once more as the process exits. That costs a
short run about 2 of its 5 seconds on this 2-core machine. So here the collector pauses while torch,
torchvision or lightning is imported, and then leaves what they made out of its walks (gc.freeze). As the process
exits, it leaves out everything. Objects a script makes while it runs are collected as usual."""
import atexit
import gc
import importlib.machinery
import sys

HEAVY = ("torch", "torchvision", "lightning")


class FrozenAfterImport:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in HEAVY:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            was_enabled = gc.isenabled()  # torchvision's import imports torch inside it
            gc.disable()
            try:
                run(module)
            finally:
                gc.freeze()
                if was_enabled:
                    gc.enable()

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, FrozenAfterImport)
atexit.register(gc.freeze)  # the first atexit function, so it runs last: no walk of the heap at the exit
