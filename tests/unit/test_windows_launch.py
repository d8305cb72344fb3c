"""The harness on Windows, with os.name emulated: torchrun's runs get USE_LIBUV=0 (PyTorch for Windows has no
libuv, which torchrun's own store asks for), and the collective check takes the scripts' backend (no NCCL there)."""
import dataclasses
import os

import pytest
import torch

from bench import plan
from bench.commands import commands
from bench.measure import allreduce
from bench.family import MODES
from helpers import gpu_settings

TORCHRUN_MODES = [name for name, mode in MODES.items() if mode.launch.torchrun]


def settings(gpus):
    """The helpers' settings with n = 2 at least and a few steps an epoch: what commands() needs."""
    return dataclasses.replace(gpu_settings(gpus, per_device_batches=[64]), max_n=max(len(gpus), 2),
                               epoch_images=5 * 64, cores=2)


def environments(gpus):
    """{mode: [each command's environment]} of every mode's n = 2 run."""
    return {name: [env for env, _ in commands(plan.Run("base", (), name, 2, 64, 1), settings(gpus), "m.json", "s.pt")]
            for name in MODES}


@pytest.mark.parametrize("gpus", [[], ["0", "1"]], ids=["cpu", "gpus"])
def test_on_windows_exactly_the_torchrun_runs_get_use_libuv_0(gpus, monkeypatch):
    assert sorted(TORCHRUN_MODES) == ["ddp_fault_tolerant", "ddp_launch", "fsdp", "fsdp_big", "fsdp_tp", "pipeline_parallel",
                                      "tensor_parallel"]  # 03 06 08 11 10 09
    monkeypatch.setattr(os, "name", "nt")
    on_windows = environments(gpus)
    monkeypatch.undo()
    for name, envs in on_windows.items():
        assert all(env.get("USE_LIBUV") == ("0" if name in TORCHRUN_MODES else None) for env in envs), (name, envs)
    assert all("USE_LIBUV" not in env for envs in environments(gpus).values() for env in envs)  # Linux: libuv


def test_the_collective_check_takes_the_scripts_backend_gloo_where_torch_has_no_nccl(monkeypatch):
    cuda, cpu = torch.device("cuda", 1), torch.device("cpu")
    assert (allreduce.backend_for(cuda), allreduce.backend_for(cpu)) == ("nccl", "gloo")  # this Linux build
    # PyTorch for Windows: built without NCCL; the device's default backend is still nccl for CUDA.
    monkeypatch.setattr(os, "name", "nt")
    monkeypatch.setattr(torch.distributed, "is_backend_available", lambda backend: backend != "nccl")
    on_windows = allreduce.backend_for(cuda), allreduce.backend_for(cpu)
    monkeypatch.undo()  # before any assertion: pytest's report of a failure needs the real os.name
    assert on_windows == ("gloo", "gloo")


def test_the_collective_check_starts_its_process_group_with_that_backend(monkeypatch):
    """The worker's own call, with the process group stood in: no hard-coded nccl left on the GPU path."""
    started = {}

    class Stop(Exception):
        pass

    def init_process_group(backend, **kwargs):
        started.update(backend=backend, device_id=kwargs.get("device_id"))
        raise Stop

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this process keeps its own
    monkeypatch.setattr(torch.distributed, "is_backend_available", lambda backend: backend != "nccl")
    args = allreduce.argparse.Namespace(cpu=False, nprocs=2)
    with pytest.raises(Stop):
        allreduce.worker(1, args, params=10)
    assert started == dict(backend="gloo", device_id=torch.device("cuda", 1))
