"""The numbered scripts by mode (as their metrics records name it), in reading order; loading one as a module."""
import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"single": "01_single_gpu.py", "dp": "02_data_parallel.py", "ddp_launch": "03_ddp_launch.py",
           "ddp_spawn": "04_ddp_spawn.py", "ddp_multinode": "05_multinode_mnist.py",
           "ddp_fault_tolerant": "06_fault_tolerant.py", "lightning": "07_lightning.py"}
MODES = list(SCRIPTS)


def load_script(name="01_single_gpu.py"):
    """A numbered script as a module (its name starts with a digit, so `import` cannot load it)."""
    spec = importlib.util.spec_from_file_location(f"script_{name[:2]}", os.path.join(REPO, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
