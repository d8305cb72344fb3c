"""08_fsdp.py's code, in this process: it keeps every definition of 03 that sharding does not change, and refuses
bad input in one line as 03 does (08 run as a user runs it: tests/integration/test_fsdp.py)."""
import pytest
import torch

from helpers import definitions, launcher_env, load_script


def test_08_keeps_every_definition_of_03_that_sharding_does_not_change():
    """Flags and their checks, the device and the refusals, the data, the training step and the timing."""
    fsdp, ddp = definitions("08_fsdp.py"), definitions("03_ddp_launch.py")
    for name in ["Net", "in_range", "writable", "parse_args", "setup", "load_mnist", "batches", "train_epoch",
                 "clock", "timed"]:
        assert fsdp[name] == ddp[name], f"08's {name} differs from 03's"


def refusal(script, argv=()):
    """What the script's setup() exits with, in this process (the test says what torch finds)."""
    module = load_script(script)
    with pytest.raises(SystemExit) as exited:
        module.setup(module.parse_args(list(argv)))
    return exited.value.code


def test_bad_input_is_refused_in_one_line_as_03_refuses_it(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    for key, value in {**launcher_env(world_size=2), "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    assert refusal("08_fsdp.py") == refusal("03_ddp_launch.py") == (
        "error: 2 processes on this machine but 1 GPU(s): start fewer, or add --cpu to try DDP on the CPU")
    assert refusal("08_fsdp.py", ["--lr", "nan"]).startswith("error: argument --lr: must be in")
    monkeypatch.delenv("RANK")  # started with python, not torchrun
    assert refusal("08_fsdp.py").startswith("error: start me with torchrun --standalone --nproc_per_node N")
