"""A Mac: 07 trains on MPS (Lightning's MPSAccelerator), and 08 on the CPU beside it (no backend takes MPS tensors),
each through an epoch's end. MPS has no float64: a float64 tensor on it raises TypeError.

This machine has no MPS. For 07 a stand-in plays it in this process: torch and Lightning report one MPS device
(tests/stand_in_accelerator's play(), and an Apple processor for Lightning), and every tensor made on "mps",
moved there or computed from one is checked as MPS checks it (float64 refused, with MPS's message) and kept on the
CPU. What it does not show: MPS's own kernels (an op MPS lacks), its memory figures, and its timing. 08 runs under
the stand-in hook as a user starts it: two processes, on the CPU."""
import json
import platform

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from helpers import run, script_command, stand_in_accelerator, with_stand_in_accelerator

lightning = pytest.importorskip("lightning", reason="07_lightning.py needs lightning (requirements.txt)",
                                exc_type=ImportError)  # installed but broken: a skip too (pytest 9.1)
from lightning.fabric.accelerators.mps import MPSAccelerator  # noqa: E402
from helpers import load_script  # noqa: E402

NO_FLOAT64 = ("Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't support float64. "
              "Please use float32 instead.")  # what torch raises on a Mac
LEAVES = {torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy}


def device_of(value):
    """The device that an argument names, or None."""
    if isinstance(value, torch.device):
        return value
    try:
        return torch.device(value) if isinstance(value, str) else None
    except RuntimeError:  # a string that names no device
        return None


def is_mps(value):
    return getattr(device_of(value), "type", None) == "mps"


class StandInMPS(TorchFunctionMode):
    """Tensors on "mps" are CPU tensors marked as on MPS; each one made is refused as MPS refuses it."""

    def __init__(self):
        super().__init__()
        self.made = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.device, torch._C._nn._parse_to):  # Module.to(mps) then moves each tensor there
            return func(*args, **kwargs)
        devices = [device_of(arg) for arg in [*args, kwargs.get("device")]]
        to_mps = any(device and device.type == "mps" for device in devices)
        to_cpu = func in LEAVES or any(device and device.type != "mps" for device in devices)
        args, kwargs = tree_map(lambda x: torch.device("cpu") if is_mps(x) else x, (args, kwargs))
        from_mps = any(getattr(arg, "on_stand_in_mps", False) for arg in tree_flatten((args, kwargs))[0])
        out = func(*args, **kwargs)
        if to_cpu and getattr(out, "on_stand_in_mps", False):  # the same tensor, which stays on MPS: a copy
            out = out.clone()
        if to_mps or (from_mps and not to_cpu):
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor):
                    if tensor.dtype == torch.float64:
                        raise TypeError(NO_FLOAT64)
                    tensor.on_stand_in_mps = True
                    self.made += 1
        return out


@pytest.fixture
def mac(monkeypatch):
    """One MPS device, as torch and Lightning report it on Apple silicon; the device calls of the measurement block
    answered (the peak memory: 0 bytes) and counted. Returns the StandInMPS mode and the calls."""
    calls = []
    stand_in_accelerator.play(monkeypatch.setattr, "mps", 1)
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    for name in ["synchronize", "reset_peak_memory_stats", "max_memory_allocated"]:
        monkeypatch.setattr(torch.accelerator, name, lambda device=None, _name=name: calls.append(_name) or 0)
    for key in ["LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_JOB_NAME", "RANK", "WORLD_SIZE"]:
        monkeypatch.delenv(key, raising=False)
    MPSAccelerator.is_available.cache_clear()
    yield StandInMPS(), calls
    MPSAccelerator.is_available.cache_clear()


def test_the_stand_in_refuses_float64_on_mps_as_a_mac_does(mac):
    mode, _ = mac
    with mode:
        on_mps = torch.zeros(3, device="mps")
        with pytest.raises(TypeError, match="float64"):
            torch.tensor([1.0, 2.0], dtype=torch.float64, device="mps")
        with pytest.raises(TypeError, match="float64"):
            torch.zeros(2, dtype=torch.float64).to(torch.device("mps"))
        with pytest.raises(TypeError, match="float64"):
            on_mps.double()
        assert on_mps.cpu().double().dtype == torch.float64  # on the CPU, float64 is fine


def test_07_trains_on_mps_through_each_epochs_end_in_float32(mac, quick_mnist_dir, tmp_path):
    mode, calls = mac
    script = load_script("07_lightning.py")
    record = tmp_path / "record.json"
    args = script.parse_args(["--data-dir", str(quick_mnist_dir), "--epochs", "2", "--max-steps", "6",
                              "--log-interval", "0", "--metrics-json", str(record)])
    with mode:
        trainer = script.setup(args)
        assert type(trainer.accelerator).__name__ == "MPSAccelerator"
        script.run(args, trainer)
    written = json.loads(record.read_text())
    assert (written["device_type"], written["device_names"], len(written["epochs_detail"])) == ("mps", ["mps"], 2)
    assert [e["test_samples"] for e in written["epochs_detail"]] == [1000, 1000]
    assert mode.made > 0 and {"synchronize", "max_memory_allocated"} <= set(calls)


@pytest.mark.parametrize("script, extra", [("08_fsdp.py", []), ("12_fsdp_big.py", ["--snapshot-every", 1])])
def test_fsdp_on_a_mac_trains_on_the_cpu_through_each_epochs_end(script, extra, quick_mnist_dir, tmp_path):
    """08, and 12 with a snapshot at every step: no MPS tensor, and no MPS RNG state, reaches a collective."""
    env, log = with_stand_in_accelerator(tmp_path, "mps")
    record = tmp_path / "record.json"
    snapshot = ["--snapshot", tmp_path / "s.pt", *extra] if extra else []
    result = run(script_command(script, "--data-dir", quick_mnist_dir, "--epochs", 2, "--max-steps", 2,
                                "--log-interval", 0, "--threads", 1, "--metrics-json", record, *snapshot, nprocs=2),
                 env=env, timeout=240)
    written = json.loads(record.read_text())
    assert (written["device_type"], written["world_size"], len(written["epochs_detail"])) == ("cpu", 2, 2)
    assert "DDP cannot use MPS: training on the CPU" in result.stderr
    assert [line for line in log.read_text().splitlines() if " used " in line] == []
