"""The one start-up hook mechanism: every sitecustomize.py of this repository starts by calling chain() here.

Python imports the first sitecustomize.py on sys.path at start-up, and no other. Ours are small folders put on
PYTHONPATH by a test or a tool: tools/copy_hook (the copy checker and the step anatomy), tests/as_on_cuda and
the others that tests/README.md lists. So that they stack, each one first runs the next sitecustomize.py on
PYTHONPATH after its own folder: a test's hook, then tests/fast_start, or a user's own one after the checker's.

    runpy.run_path(str(pathlib.Path(__file__).resolve().parents[2] / "tools" / "startup_hook.py"))["chain"](__file__)
"""
import os
import runpy


def chain(hook_file):
    """Run the next sitecustomize.py on PYTHONPATH after the folder of hook_file, if there is one."""
    path = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    here = os.path.dirname(os.path.abspath(hook_file))
    later = [p for p in path[path.index(here) + 1 if here in path else len(path):]
             if os.path.isfile(os.path.join(p, "sitecustomize.py"))]
    if later:
        runpy.run_path(os.path.join(later[0], "sitecustomize.py"), run_name="later_sitecustomize")
