"""Every machine a reader has. The scripts take CUDA, MPS, XPU or the CPU through torch.accelerator: this machine
has no accelerator, so stand-ins play each one (torch.accelerator answering as on that machine, no device touched).
The machine label is worked out as macOS and Windows would, and the harness stops a run as on Windows. (No call
that only Linux has, with what Windows lacks hidden from the repository's own code, run as a user runs it:
tests/integration/test_no_linux_only.py.)"""
import io
import os
import re
import runpy
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torchvision  # noqa: F401  (it imports torch._dynamo, which reads what stand_in replaces: first)

from bench import machine, processes
from helpers import MODES, ROOT, launcher_env, load_script, stand_in_accelerator

CPU = torch.device("cpu")
# Started by torchrun, they count the GPUs in setup(); 04 and 05 count them once, in the parent's parse_args().
LAUNCHED = [mode.script for mode in MODES.values() if mode.launch.torchrun]  # 03, 06, 08 and after
SPAWNING = {"04_ddp_spawn.py": "--nprocs", "05_multinode_mnist.py": "-g"}  # the flag that sets processes per machine


@pytest.fixture
def stand_in(monkeypatch):
    """use(kind, count): torch reports `count` devices of an accelerator of that kind ("cuda", "mps", "xpu"; None:
    no accelerator), as torch.accelerator, torch.cuda (02 and 07 count CUDA GPUs) and torch.backends.mps (07) do
    there (the hook of tests/stand_in_accelerator, which runs whole scripts so). Returns the indices that
    set_device_index was given."""
    chosen = []

    def use(kind, count=1):
        stand_in_accelerator.play(monkeypatch.setattr, kind, count)
        monkeypatch.setattr(torch.accelerator, "set_device_index", chosen.append)
        return chosen
    return use


@pytest.fixture
def groups(monkeypatch):
    """The (backend, device_id) of each init_process_group call, which does nothing more: no NCCL here."""
    calls = []
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend=None, **options: calls.append((backend, options.get("device_id"))))
    return calls


def launched(monkeypatch, processes=1):
    """This process as rank 0 of `processes` on one machine, with the variables torchrun (or 04's and 05's worker)
    sets; no agent store (06 would ask torchrun's)."""
    env = {**launcher_env(processes), "LOCAL_WORLD_SIZE": str(processes)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)


def assert_refused(exited, processes, gpus):
    """One `error:` line that names both counts and both ways out: fewer processes, or --cpu."""
    message = str(exited.value.code)
    assert message.startswith("error:") and "\n" not in message, message
    assert re.search(rf"\b{processes} processes\b", message) and re.search(rf"\b{gpus} GPU", message), message
    assert "fewer" in message and "--cpu" in message, message


@pytest.mark.parametrize("kind", ["cuda", "mps", "xpu", None])
def test_01_trains_on_the_accelerator_there_is_and_on_the_cpu_with_cpu(kind, stand_in):
    stand_in(kind)
    single = load_script("01_single_gpu.py")
    assert single.setup(single.parse_args([])).device == (torch.device(kind) if kind else CPU)
    assert single.setup(single.parse_args(["--cpu"])).device == CPU


@pytest.mark.parametrize("kind", ["mps", "xpu"])
def test_02_on_an_accelerator_other_than_cuda_says_in_one_line_that_dp_needs_cuda_and_trains_one_replica(
        kind, stand_in, capsys):
    stand_in(kind, count=2)
    dp = load_script("02_data_parallel.py")
    world = dp.setup(dp.parse_args([]))
    said = capsys.readouterr().err.splitlines()
    assert (world.devices, world.world_size) == ([torch.device(kind)], 1)
    assert len(said) == 1 and "DataParallel" in said[0] and "CUDA" in said[0], said


def test_02_on_cuda_splits_over_every_gpu_without_a_word(stand_in, capsys):
    stand_in("cuda", count=2)
    dp = load_script("02_data_parallel.py")
    world = dp.setup(dp.parse_args([]))
    assert world.devices == [torch.device("cuda", 0), torch.device("cuda", 1)] and world.world_size == 1
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name", LAUNCHED + list(SPAWNING))
def test_ddp_on_mps_trains_on_the_cpu_with_gloo_and_says_so_in_one_line(name, stand_in, monkeypatch, capsys):
    stand_in("mps")
    launched(monkeypatch)
    script = load_script(name)
    try:
        world = script.setup(script.parse_args([]))
        assert (world.device, dist.get_backend()) == (CPU, "gloo")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "MPS" in said[0] and "CPU" in said[0], said


@pytest.mark.parametrize("name", LAUNCHED + list(SPAWNING))
def test_ddp_takes_nccl_for_cuda_one_gpu_per_process_and_gloo_for_the_cpu(name, stand_in, groups, monkeypatch):
    assert dist.get_default_backend_for_device(torch.device("cuda", 0)) == "nccl"
    assert dist.get_default_backend_for_device(CPU) == "gloo"
    chosen = stand_in("cuda", count=1)
    launched(monkeypatch)
    script = load_script(name)
    world = script.setup(script.parse_args([]))
    assert (world.device, chosen) == (torch.device("cuda", 0), [0])
    assert groups == [("nccl", torch.device("cuda", 0))]
    world = script.setup(script.parse_args(["--cpu"]))
    assert (world.device, chosen) == (CPU, [0])
    assert groups[-1] == ("gloo", None)


@pytest.mark.parametrize("name", LAUNCHED + list(SPAWNING))
def test_ddp_on_cuda_without_nccl_as_on_windows_takes_gloo_on_the_gpu(name, stand_in, groups, monkeypatch):
    """PyTorch for Windows has no NCCL; gloo takes CUDA tensors, so DDP still trains on the GPU."""
    monkeypatch.setattr(dist, "is_backend_available", lambda backend: backend != "nccl")
    stand_in("cuda", count=1)
    launched(monkeypatch)
    script = load_script(name)
    world = script.setup(script.parse_args([]))
    assert world.device == torch.device("cuda", 0)
    assert groups == [("gloo", torch.device("cuda", 0))]


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
@pytest.mark.parametrize("name", LAUNCHED)
def test_more_processes_than_gpus_are_refused_in_one_line_before_the_process_group(name, kind, stand_in, groups,
                                                                                   monkeypatch):
    stand_in(kind, count=1)
    launched(monkeypatch, processes=2)
    script = load_script(name)
    with pytest.raises(SystemExit) as exited:
        script.setup(script.parse_args([]))
    assert_refused(exited, processes=2, gpus=1)
    assert groups == []


@pytest.mark.parametrize("name", SPAWNING)
def test_spawning_scripts_refuse_more_processes_than_gpus_in_the_parent_before_any_process(name, stand_in,
                                                                                         monkeypatch):
    flag = SPAWNING[name]
    stand_in("cuda", count=1)
    spawned = []
    monkeypatch.setattr(torch.multiprocessing, "spawn", lambda *args, **options: spawned.append(options))
    monkeypatch.setattr(sys, "argv", [name, flag, "2"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / name), run_name="__main__")
    assert_refused(exited, processes=2, gpus=1)
    assert spawned == []
    script = load_script(name)  # both ways out are taken
    assert script.parse_args([flag, "2", "--cpu"]).nprocs == 2
    assert script.parse_args([flag, "1"]).nprocs == 1
    stand_in("mps", count=1)  # DDP's processes train on the CPU there: any number
    assert script.parse_args([flag, "2"]).nprocs == 2


@pytest.mark.parametrize("kind", ["cuda", "mps"])
def test_07_counts_cuda_or_mps_gpus_and_refuses_more_devices_in_one_line(kind, stand_in, monkeypatch):
    stand_in(kind, count=1)
    for key in ["LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_JOB_NAME"]:  # not under torchrun or srun
        monkeypatch.delenv(key, raising=False)
    lightning = load_script("07_lightning.py")
    with pytest.raises(SystemExit) as exited:
        lightning.setup(lightning.parse_args(["--devices", "2"]))
    assert_refused(exited, processes=2, gpus=1)
    trainer = lightning.setup(lightning.parse_args(["--devices", "2", "--cpu"]))
    assert type(trainer.accelerator).__name__ == "CPUAccelerator"


@pytest.mark.parametrize("strategy, start", [("auto", "popen"), ("ddp", "popen"), ("ddp_spawn", "spawn")])
def test_07_without_nccl_as_on_windows_asks_lightning_for_gloo(strategy, start, monkeypatch):
    """Lightning picks NCCL for CUDA by itself; PyTorch for Windows has none, so 07 asks for gloo there."""
    for key in ["LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_JOB_NAME"]:
        monkeypatch.delenv(key, raising=False)
    lightning = load_script("07_lightning.py")
    monkeypatch.setattr(lightning.dist, "is_nccl_available", lambda: False)
    trainer = lightning.setup(lightning.parse_args(["--devices", "2", "--cpu", "--strategy", strategy]))
    assert (trainer.strategy.process_group_backend, trainer.strategy._start_method) == ("gloo", start)
    monkeypatch.setattr(lightning.dist, "is_nccl_available", lambda: True)  # Linux: Lightning chooses
    assert lightning.setup(lightning.parse_args(["--devices", "2", "--cpu"])).strategy.process_group_backend is None


# ---- The machine label (results/<label>, plot titles) on each OS, from the standard library only.

CPUINFO = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: {}\nflags\t\t: fpu\n\n"
WINDOWS_NAME = "Intel64 Family 6 Model 154 Stepping 3, GenuineIntel"  # platform.processor() there


@pytest.fixture
def no_linux(monkeypatch):
    """answering(answers): as on macOS or Windows, no /proc/cpuinfo and no os.sched_getaffinity, 12 cores, and the
    commands machine runs answered from `answers` by name (None: missing). Returns the commands it ran."""
    asked = []

    def answering(answers):
        exists = os.path.exists
        monkeypatch.setattr(os.path, "exists", lambda path: path != "/proc/cpuinfo" and exists(path))
        monkeypatch.delattr(os, "sched_getaffinity", raising=False)
        monkeypatch.setattr(os, "cpu_count", lambda: 12)
        monkeypatch.setattr(machine, "output_of", lambda argv: asked.append(argv) or answers.get(argv[0]))
        return asked
    return answering


def on_windows(monkeypatch, work):
    """work() with os.name "nt" and no os.sysconf, undone before anything else runs (pytest's own reporting
    needs the real os.name)."""
    with monkeypatch.context() as windows:
        windows.setattr(os, "name", "nt")
        windows.delattr(os, "sysconf", raising=False)
        windows.setattr(machine.platform, "processor", lambda: WINDOWS_NAME)
        return work()


def linux_label(monkeypatch, model, cores):
    monkeypatch.setattr(os.path, "exists", lambda path, exists=os.path.exists: path == "/proc/cpuinfo" or exists(path))
    monkeypatch.setattr(machine, "open", lambda path: io.StringIO(CPUINFO.format(model)), raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    return machine.machine_tag([])


def test_the_linux_label_comes_from_cpuinfo_and_the_cores_this_process_may_use(monkeypatch):
    assert linux_label(monkeypatch, "AMD EPYC", cores=2) == "cpu-2core-amd-epyc"  # results/ of this machine
    assert machine.hardware_label([], 2) == "CPU only: AMD EPYC, 2 cores, up to 2 processes (gloo)"
    assert machine.machine_tag(["NVIDIA H200"] * 4) == "4x-nvidia-h200"


def test_macos_names_the_cpu_with_sysctl_and_counts_all_cores(no_linux):
    asked = no_linux({"sysctl": "Apple M2 Pro"})
    assert machine.machine_tag([]) == "cpu-12core-apple-m2-pro"
    assert machine.hardware_label([], 2) == "CPU only: Apple M2 Pro, 12 cores, up to 2 processes (gloo)"
    assert ["sysctl", "-n", "machdep.cpu.brand_string"] in asked


def test_windows_names_the_cpu_as_linux_does_and_records_no_memory_figure(no_linux, monkeypatch):
    brand = "12th Gen Intel(R) Core(TM) i7-12700H"
    with monkeypatch.context() as on_linux:
        linux = linux_label(on_linux, brand, cores=12)
    asked = no_linux({"powershell": brand})
    windows, env = on_windows(monkeypatch, lambda: (machine.machine_tag([]), machine.environment(str(ROOT), [])))
    assert windows == linux == "cpu-12core-12th-gen-intel-core-i7-12700h"  # one CPU, one label, whatever the OS
    assert asked[0][0] == "powershell" and "Win32_Processor" in asked[0][-1]
    assert (env["cpu_model"], env["cpu_cores"], env["memory_gib"]) == (brand, 12, None)


def test_without_the_os_tool_the_label_is_what_platform_knows(no_linux, monkeypatch):
    no_linux({})
    label = on_windows(monkeypatch, lambda: machine.machine_tag([]))
    assert label == "cpu-12core-intel64-family-6-model-154-stepping-3-genuineintel"


# ---- No call that only Linux has: the harness's way to stop a run (the hook that hides what Windows lacks:
# tests/integration/test_no_linux_only.py).

def test_on_windows_the_harness_stops_a_run_with_all_it_started_by_taskkill(monkeypatch):
    """Windows has no process groups and no SIGKILL: each run's process tree ends with taskkill /T /F."""
    run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    asked = []
    monkeypatch.setattr(processes.os, "killpg", lambda *args: pytest.fail("killpg on Windows"), raising=False)
    monkeypatch.setattr(processes.subprocess, "run", lambda argv, **kw: asked.append(argv) or run.kill())
    try:
        on_windows(monkeypatch, lambda: processes.stop([run]))
    finally:
        run.kill()
    assert asked == [["taskkill", "/T", "/F", "/PID", str(run.pid)]] and run.wait(timeout=10) != 0
