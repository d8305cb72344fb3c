"""What this machine is (CPU, GPUs, versions, numerics settings), recorded beside every result; a free TCP port."""
import json
import os
import platform
import re
import socket
import subprocess
import sys

# In a child process (the harness never imports torch): torch's report, versions it omits, the TF32/cuDNN settings.
TORCH_REPORT = """import json, torch, torchvision, torch.utils.collect_env as collect_env
from torch.backends import cuda, cudnn
print(json.dumps(dict(collect_env.get_env_info()._asdict(), torchvision_version=torchvision.__version__,
      nccl_version=".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
      matmul_allow_tf32=cuda.matmul.allow_tf32, cudnn_allow_tf32=cudnn.allow_tf32, cudnn_benchmark=cudnn.benchmark,
      cudnn_deterministic=cudnn.deterministic, cudnn_version=cudnn.version(),
      float32_matmul_precision=torch.get_float32_matmul_precision())))"""
COUNT_GPUS = "import torch; print(torch.cuda.device_count())"
BRAND = {"posix": ["sysctl", "-n", "machdep.cpu.brand_string"],  # the CPU's name on macOS, and on Windows:
         "nt": ["powershell", "-NoProfile", "-Command", "(Get-CimInstance Win32_Processor)[0].Name"]}
# A command (nvidia-smi, collect_env) silent this long is hung; a GPU check's step sets BENCH_COMMAND_TIMEOUT_S lower.
COMMAND_TIMEOUT_S = 120


def free_port():
    """A port the OS just found free (the tiny race until a run binds it is acceptable here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def output_of(argv):
    """stdout of a command, less the escape codes nvidia-smi writes even into a pipe; None if it is missing or fails."""
    timeout = float(os.environ.get("BENCH_COMMAND_TIMEOUT_S") or COMMAND_TIMEOUT_S)
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):  # missing, not runnable, or hung
        return None
    return re.sub(r"\x1b\[[0-9;]*m", "", out.stdout).strip() if out.returncode == 0 else None


def gpus():
    """[(id, name)] of the GPUs runs may use, ids as in CUDA_VISIBLE_DEVICES: those it lists, else all, by PCI bus."""
    listed = output_of(["nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader"]) or ""
    names = {key: name for i, uuid, name in (line.split(", ", 2) for line in listed.splitlines()) for key in (i, uuid)}
    if not listed:  # no nvidia-smi: ask torch, in a child process, how many GPUs it sees
        names = {str(i): "GPU" for i in range(int(output_of([sys.executable, "-c", COUNT_GPUS]) or 0))}
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [i for i in names if not i.startswith("GPU-")] if chosen is None else [i for i in chosen.split(",") if i]
    return [(i.strip(), names.get(i.strip(), "unknown GPU")) for i in ids]


def cpu_model():
    """The CPU's brand string, one text for one CPU on every OS: Linux's /proc/cpuinfo, else the OS's own tool."""
    if not os.path.exists("/proc/cpuinfo"):
        return output_of(BRAND[os.name]) or platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())


def cpu_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # Linux: affinity


def hardware_label(gpu_names, cpu_processes):  # one line for plot titles and the report
    cpu = f"CPU only: {cpu_model()}, {cpu_cores()} cores, up to {cpu_processes} processes (gloo)"
    return f"{len(gpu_names)}x {' + '.join(sorted(set(gpu_names)))}" if gpu_names else cpu


def machine_tag(gpu_names):
    """results/<tag>: the hardware a sweep ran on, e.g. 4x-nvidia-h200 or cpu-2core-intel-xeon-processor."""
    name = re.sub(r"\((r|tm)\)|\bcpu\b|@.*$", "", (gpu_names[0] if gpu_names else cpu_model()).lower())
    name = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    return f"{len(gpu_names)}x-{name}" if gpu_names else f"cpu-{cpu_cores()}core-{name}"


def environment(repo, gpus_used):
    torch_report = output_of([sys.executable, "-c", TORCH_REPORT])
    git = output_of(["git", "-C", repo, "rev-parse", "HEAD"])
    return dict(
        host=socket.gethostname(), cpu_model=cpu_model(), cpu_cores=cpu_cores(),
        memory_gib=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        if hasattr(os, "sysconf") else None,  # Linux and macOS have sysconf, Windows not
        gpus_used=", ".join(f"{i}: {name}" for i, name in gpus_used),
        nvidia_smi_topo=output_of(["nvidia-smi", "topo", "-m"]),
        git_commit=git, git_dirty=bool(output_of(["git", "-C", repo, "status", "--porcelain"])) if git else None,
        **(json.loads(torch_report) if torch_report else {"torch_error": f"{sys.executable} cannot import torch"}))
