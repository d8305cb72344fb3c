"""pytest's hooks and the shared fixtures: the markers, the skip of tests marked gpu where there is no CUDA, a small
learnable MNIST in torchvision's raw layout, and a stand-in nvidia-smi. What the tests share besides: helpers.py."""
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `from helpers import ...` in both tiers' files
from helpers import HOOKS, NVIDIA_SMI, QUICK_TEST_IMAGES, TRAIN_IMAGES, fake_command, write_fake_mnist  # noqa: E402


# Every Python the tests start takes tests/fast_start's sitecustomize: the garbage collector skips torch's own
# objects, so each process starts and ends sooner. Last on PYTHONPATH: the other hooks there run it first.
FAST_START = str(HOOKS["fast_start"])
if FAST_START not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), FAST_START]))

# A pytest started in the background by a script (`python -m pytest tests &`) inherits SIGINT ignored, and so would
# every process it starts: the tests that interrupt a worker need SIGINT as a terminal gives it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped where there is none)")
    config.addinivalue_line("markers", "two_ranks: two ranks on one GPU, as two nodes (the GPU check's own step)")
    config.addinivalue_line("markers", "slurm: needs root, SLURM and munge (skipped where they are missing)")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def quick_mnist_dir(tmp_path_factory):
    """A small learnable MNIST in torchvision's raw layout: TRAIN_IMAGES and QUICK_TEST_IMAGES images."""
    return Path(write_fake_mnist(str(tmp_path_factory.mktemp("mnist-quick")), train=TRAIN_IMAGES,
                                 test=QUICK_TEST_IMAGES))


@pytest.fixture
def two_gpus(tmp_path, monkeypatch):
    """nvidia-smi lists two GPUs; another process holds 40 GB of GPU 0 (helpers.NVIDIA_SMI)."""
    if os.name == "nt":
        pytest.skip("the stand-in nvidia-smi is a shell script")
    env = fake_command(tmp_path, "nvidia-smi", NVIDIA_SMI)
    monkeypatch.setenv("PATH", env["PATH"])
    return env
