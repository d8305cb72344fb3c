"""What the machine is: GPUs, CPU, versions. Stored beside every result so that it can be compared later."""
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys


def _run(cmd, timeout=30):
    """stdout of a command, or None when it is missing or fails (no nvidia-smi on a CPU machine)."""
    if not shutil.which(cmd[0]):
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    # nvidia-smi underlines its header with terminal escape codes even into a pipe: keep the text only.
    return re.sub(r"\x1b\[[0-9;]*m", "", out.stdout).strip() if out.returncode == 0 else None


def gpus():
    """[(index, name, driver, memory)] of every GPU on the machine, whatever CUDA_VISIBLE_DEVICES says.

    nvidia-smi numbers GPUs the way CUDA_VISIBLE_DEVICES does (with the default PCI order set for the runs);
    without it we ask torch in a child process, so the harness itself never initialises CUDA.
    """
    out = _run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader"])
    if out:
        return [tuple(field.strip() for field in line.split(",")) for line in out.splitlines() if line.strip()]
    code = ("import torch\nfor i in range(torch.cuda.device_count()):\n"
            "    print(i, torch.cuda.get_device_name(i), sep='|')")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    except (OSError, subprocess.SubprocessError):
        return []
    return [tuple(line.split("|")) + ("", "") for line in out.stdout.splitlines() if "|" in line]


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def slug(text):
    text = re.sub(r"\((r|tm)\)|\bcpu\b|@.*$", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def machine_tag(gpu_names, cpu_processes):
    """results/<tag>: the hardware a sweep ran on, e.g. 4x-nvidia-h200 or cpu-2core-intel-xeon-processor."""
    if gpu_names:
        return f"{len(gpu_names)}x-{slug(gpu_names[0])}"
    return f"cpu-{cpu_cores()}core-{slug(cpu_model())}"


def hardware_label(gpu_names, cpu_processes):
    """One line for plot titles and the report."""
    if gpu_names:
        names = sorted(set(gpu_names))
        return f"{len(gpu_names)}x {' + '.join(names)}"
    return f"CPU only: {cpu_model()}, {cpu_cores()} cores, up to {cpu_processes} processes (gloo)"


def _torch_versions():
    """torch, CUDA and NCCL versions from a child process: importing torch here would slow every --help."""
    code = ("import json, torch, torchvision\n"
            "nccl = None\n"
            "try:\n    nccl = '.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None\n"
            "except Exception:\n    pass\n"
            "print(json.dumps(dict(torch=torch.__version__, torchvision=torchvision.__version__,"
            " cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), nccl=nccl,"
            " cuda_available=torch.cuda.is_available())))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as e:  # versions are nice to have; a broken torch shows up in the runs anyway
        return {"error": f"{type(e).__name__}: {e}"}


def collect(repo, selected_gpus):
    """The environment record written to env.json."""
    all_gpus = gpus()
    chosen = [g for g in all_gpus if g[0] in selected_gpus]
    git = _run(["git", "-C", repo, "rev-parse", "HEAD"])
    dirty = _run(["git", "-C", repo, "status", "--porcelain"])
    return dict(
        host=socket.gethostname(), platform=platform.platform(), python=sys.version.split()[0],
        cpu_model=cpu_model(), cpu_cores=cpu_cores(), cpu_count=os.cpu_count(),
        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        gpu_count=len(all_gpus), gpus_used=[dict(index=g[0], name=g[1]) for g in chosen],
        gpu_names=[g[1] for g in all_gpus], driver=all_gpus[0][2] if all_gpus else None,
        **_torch_versions(),
        nvidia_smi_topo=_run(["nvidia-smi", "topo", "-m"]),
        git_commit=git, git_dirty=bool(dirty) if git else None,
    )
