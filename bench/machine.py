"""What this machine is: CPU, GPUs, versions and the settings that change numerics, recorded beside every
result so that it can be compared later; and a free TCP port for a run's rendezvous."""
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys

# torch's own environment report (torch.utils.collect_env), the versions it leaves out and the TF32/cuDNN
# settings runs start with (the scripts do not change them), from a child process: the harness itself never
# imports torch, so it never initialises CUDA and --help stays instant.
TORCH_REPORT = """import json, warnings, torch, torchvision
from torch.utils import collect_env
warnings.simplefilter("ignore")  # allow_tf32 is deprecated in new releases; its value still applies
info = collect_env.get_env_info()._asdict()
info.update(torchvision_version=torchvision.__version__,
            nccl_version=".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
            matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32, cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
            cudnn_benchmark=torch.backends.cudnn.benchmark, cudnn_deterministic=torch.backends.cudnn.deterministic,
            cudnn_version=torch.backends.cudnn.version(), float32_matmul_precision=torch.get_float32_matmul_precision())
print(json.dumps(info))"""
LIST_GPUS = "import torch\nfor i in range(torch.cuda.device_count()): print(torch.cuda.get_device_name(i))"


def free_port():
    """A port the OS just found free (the tiny race until a run binds it is acceptable here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def output_of(argv, timeout=120):
    """stdout of a command, or None when it is missing or fails (no nvidia-smi on a CPU machine)."""
    if not shutil.which(argv[0]):
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    # nvidia-smi underlines its header with terminal escape codes even into a pipe: keep the text only.
    return re.sub(r"\x1b\[[0-9;]*m", "", out.stdout).strip() if out.returncode == 0 else None


def gpus():
    """[(id, name)] of the GPUs runs may use, each id as CUDA_VISIBLE_DEVICES names it.

    A CUDA_VISIBLE_DEVICES the user set chooses them; otherwise every GPU, numbered as nvidia-smi does
    (the runs get CUDA_DEVICE_ORDER=PCI_BUS_ID, so CUDA numbers them alike).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    chosen = None if visible is None else [v.strip() for v in visible.split(",") if v.strip()]
    listed = output_of(["nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader"])
    if listed is None:  # no nvidia-smi: ask torch, which sees only the chosen GPUs, in their order
        names = (output_of([sys.executable, "-c", LIST_GPUS]) or "").splitlines()
        return list(zip(chosen if chosen is not None else map(str, range(len(names))), names))
    names, order = {}, []
    for index, uuid, name in (line.split(", ", 2) for line in listed.splitlines()):
        names[index] = names[uuid] = name
        order.append(index)
    return [(i, names.get(i, f"GPU {i}")) for i in (chosen if chosen is not None else order)]


def cpu_model():
    with open("/proc/cpuinfo") as f:
        models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return models[0] if models else platform.processor() or platform.machine()


def cpu_cores():
    return len(os.sched_getaffinity(0))


def hardware_label(gpu_names, cpu_processes):
    """One line for plot titles and the report."""
    if gpu_names:
        return f"{len(gpu_names)}x {' + '.join(sorted(set(gpu_names)))}"
    return f"CPU only: {cpu_model()}, {cpu_cores()} cores, up to {cpu_processes} processes (gloo)"


def machine_tag(gpu_names):
    """results/<tag>: the hardware a sweep ran on, e.g. 4x-nvidia-h200 or cpu-2core-intel-xeon-processor."""
    def slug(text):
        text = re.sub(r"\((r|tm)\)|\bcpu\b|@.*$", "", text.lower())
        return re.sub(r"[^a-z0-9]+", "-", text).strip("-")
    return f"{len(gpu_names)}x-{slug(gpu_names[0])}" if gpu_names else f"cpu-{cpu_cores()}core-{slug(cpu_model())}"


def environment(repo, gpus_used):
    """The environment record (env.json): this machine, the GPUs used, torch's report, the git commit."""
    torch_report = output_of([sys.executable, "-c", TORCH_REPORT])
    git = output_of(["git", "-C", repo, "rev-parse", "HEAD"])
    return dict(
        host=socket.gethostname(), cpu_model=cpu_model(), cpu_cores=cpu_cores(),
        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        gpus_used=[dict(id=i, name=name) for i, name in gpus_used], nvidia_smi_topo=output_of(["nvidia-smi", "topo", "-m"]),
        git_commit=git, git_dirty=bool(output_of(["git", "-C", repo, "status", "--porcelain"])) if git else None,
        **(json.loads(torch_report) if torch_report else {"torch_error": f"{sys.executable} cannot import torch"}))
