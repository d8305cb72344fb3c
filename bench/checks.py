"""Standard-library checks of a machine (GPUs held, /dev/shm, ports, interfaces) and of a failure's cause and fix."""
import os
import shutil
import socket
from collections import Counter
from itertools import combinations

from bench.machine import output_of

BUSY_MIB = 256  # an idle GPU shows a few MiB (the driver's own); more means a process holds memory there
OLDEST_CAPABILITY, LAST_TORCH_FOR_OLDER = (7, 5), (2, 14)  # torch 2.15 has no build below 7.5: V100 and older
SHM_LOW_BYTES = 1 << 30  # DataLoader workers and NCCL's transport within a node live in it; docker gives 64 MiB
# torch's abort at a process's exit after a good run: a gloo thread frees a finished collective's tensors while
# Python shuts down. How often the sweep, the doctor, the tests and check_copy run such a run again.
EXIT_ABORT, EXIT_ABORT_AGAIN = "terminate called without an active exception", 2
DEFAULT_PORT = 29500  # torchrun's, and 04's and 05's --master-port unless MASTER_PORT is set

# (texts naming the failure, its cause and fix), most specific first: the first match counts. The tests cite each.
ADVICE = [
    (("unable to find address for", "unable to find interface for", "interface found"),
     "GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME names an interface that does not exist or has no address: unset "
     "them, or name one that `ip addr` (Windows: ipconfig) lists, e.g. lo on one machine"),
    (("/dev/shm", "no space left on device", "bus error", "shared memory"),
     "/dev/shm (DataLoader workers, NCCL) is too small; docker gives 64 MiB: run it with --shm-size=8g or --ipc=host"),
    (("multiple ranks are using the same gpu", "duplicate gpu detected"),  # the second: NCCL before 2.30's
     "two ranks use the same GPU: each rank takes cuda:LOCAL_RANK, and CUDA_VISIBLE_DEVICES lists a GPU per process. "
     "To share one on purpose: NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL 2.30+), else a NCCL_HOSTID per rank"),
    (("mismatched nccl version detected", "nccl version mismatch with remote peer"),
     "the ranks run different NCCL versions (another torch, or a system libnccl first on LD_LIBRARY_PATH): "
     "install the same torch on every node (pip install -r requirements.txt)"),
    (("nccl library is too old",),
     "an older libnccl comes first on LD_LIBRARY_PATH: take its folder out, or reinstall torch's nvidia-nccl package"),
    (("p2p is disabled between",),
     "peer-to-peer is disabled between linked GPUs (driver, a VM's IOMMU, hardware): `nvidia-smi topo -p2p r` shows "
     "the pairs; NCCL_IGNORE_DISABLED_P2P=1 goes on over a slower path"),
    (("detected mixed local net device counts",),
     "the nodes see different numbers of network devices: name the same ones on each (NCCL_SOCKET_IFNAME, "
     "NCCL_IB_HCA), or set NCCL_IGNORE_NET_MISMATCH=1"),
    (("cuda out of memory", "out of memory"),
     "GPU memory is full: nvidia-smi shows who holds it. Stop them, choose free GPUs (--gpus), or lower the batch"),
    (("driver on your system is too old",),
     "the NVIDIA driver is older than this torch's CUDA: update the driver, or install a torch for an older CUDA"),
    (("no gpus found", "requires at least one cuda device", "no cuda gpus are available", "not compiled with cuda"),
     "this torch sees no GPU (a CPU-only build, or CUDA_VISIBLE_DEVICES hides them): install a CUDA build "
     "(pytorch.org/get-started), or run on the CPU with --cpu N"),  # the second: torch 2.15's nccl2
    (("peer access", "cuda failure", "unhandled cuda error"),
     "a CUDA call inside NCCL failed, often a peer-to-peer copy (common in VMs, or with PCIe ACS/IOMMU on): retry "
     "with NCCL_P2P_DISABLE=1; NCCL_DEBUG=INFO names it"),
    (("address already in use", "eaddrinuse"),
     "the port is taken by another job or a leftover process: choose another --master-port, or torchrun --standalone"),
    (("connection refused", "trying to connect to", "failed to connect"),
     "nothing answers at MASTER_ADDR:MASTER_PORT: rank 0 did not start or died (its log says why), or the address "
     "or port is wrong or firewalled"),
    (("unhandled system error", "remote process exited or there was a network error"),
     "a system call or the network failed inside NCCL, often a small /dev/shm or the wrong interface: rerun with "
     "NCCL_DEBUG=INFO; docker --shm-size=8g; NCCL_SOCKET_IFNAME=<interface>"),
    (("timed out", "timing out", "socket timeout", "timeout after", "timeout waiting", "operation timeout",
      "no answer within", "killed after"),  # the last two: the harness's own words for a run it had to stop
     "a peer never arrived or a collective hung: read the other ranks' logs. On GPUs retry with NCCL_P2P_DISABLE=1 "
     "and NCCL_DEBUG=INFO; across machines set NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME to the linking interface"),
    (("nccl warn",),
     "NCCL warned (the line above says what): NCCL_DEBUG=INFO shows its transport; NCCL_P2P_DISABLE=1 for P2P"),
]
GENERIC_ADVICE = "rerun with NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL: the log then names the cause"


def advice(text):
    """The likely cause and the fix, one line, for the text of a failed collective or run (its error and log)."""
    lowered = (text or "").lower()
    for _, fix in ADVICE:  # a text that already carries advice (the harness adds it) must not match its words
        lowered = lowered.replace(fix.lower(), "")
    return next((fix for needles, fix in ADVICE if any(n in lowered for n in needles)), GENERIC_ADVICE)


def cause_line(text):
    """The line of a log that names the failure: the last with a text of ADVICE, else the last error, else the last."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    named = [line for line in lines if any(n in line.lower() for needles, _ in ADVICE for n in needles)]
    errors = [line for line in lines if "error" in line.lower()]
    return ((named or errors or lines or [""])[-1])[:300]


def csv_rows(argv):
    """nvidia-smi's --format=csv,noheader,nounits rows as lists of fields; [] where it is missing or fails."""
    return [[field.strip() for field in line.split(",")] for line in (output_of(argv) or "").splitlines()
            if line.strip()]


def mib(text):
    return int(text) if text.isdigit() else None  # "[N/A]" where the driver cannot tell (Windows' WDDM mode)


def gpu_usage(ids):
    """{id: {"memory_used_mib", "processes": [{"pid", "name", "memory_mib"}]}}, ids as in CUDA_VISIBLE_DEVICES;
    {} without nvidia-smi. Another container's processes are not listed, only their memory."""
    gpus = csv_rows(["nvidia-smi", "--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits"])
    apps = csv_rows(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                     "--format=csv,noheader,nounits"])
    usage = {}
    for index, uuid, used in (row[:3] for row in gpus if len(row) >= 3):
        usage[index] = usage[uuid] = dict(memory_used_mib=mib(used), processes=[
            dict(pid=int(pid), name=os.path.basename(name), memory_mib=mib(memory))
            for gpu, pid, name, memory in (row[:4] for row in apps if len(row) >= 4) if gpu == uuid and pid.isdigit()])
    return {i: usage[i] for i in ids if i in usage}


def compute_capabilities(ids):
    """{id: (major, minor)}, ids as in CUDA_VISIBLE_DEVICES; {} where nvidia-smi cannot tell (missing, before R510)."""
    rows = csv_rows(["nvidia-smi", "--query-gpu=index,uuid,compute_cap", "--format=csv,noheader"])
    found = {key: release(row[2]) for row in rows if len(row) >= 3 for key in row[:2]}
    return {i: found[i] for i in ids if found.get(i)}


def release(version):
    """(major, minor) of a version string such as torch's "2.14.1+cu130"; None where it has none."""
    parts = (version or "").split("+")[0].split(".")
    return tuple(map(int, parts[:2])) if len(parts) >= 2 and all(p.isdigit() for p in parts[:2]) else None


def busy(usage):
    """One line per GPU of gpu_usage() that another process holds: its memory and the processes, if visible."""
    lines = []
    for gpu, use in usage.items():
        held = ", ".join(f"pid {p['pid']} {p['name']} ({p['memory_mib']} MiB)" for p in use["processes"])
        if use["processes"] or (use["memory_used_mib"] or 0) >= BUSY_MIB:
            lines.append(f"GPU {gpu}: {use['memory_used_mib']} MiB in use" + (f" by {held}" if held else
                                                                              " (by processes not visible here)"))
    return lines


def shm_free_bytes():
    """Free bytes in /dev/shm, or None where there is none (macOS, Windows)."""
    return shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None


def port_in_use(port):
    """Whether a server could not listen on this port now, on every interface as torchrun's store does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def interface_names():
    """This machine's network interfaces ([] where Python cannot list them)."""
    try:
        return [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):
        return []


def missing_interfaces(environ=None):
    """["GLOO_SOCKET_IFNAME=eth9", ...]: interface settings naming no interface of this machine. Gloo takes exact
    names; NCCL prefixes unless they start with '=', and '^' excludes (then nothing is missing)."""
    environ, names, missing = os.environ if environ is None else environ, interface_names(), []
    for variable, exact in (("GLOO_SOCKET_IFNAME", True), ("NCCL_SOCKET_IFNAME", False)):
        wanted = environ.get(variable, "")
        if not names or not wanted or wanted.startswith("^"):
            continue
        exact = exact or wanted.startswith("=")
        for item in wanted.lstrip("=").split(","):
            if item and not any(name == item if exact else name.startswith(item) for name in names):
                missing.append(f"{variable}={item}")
    return missing


def links(topo, ids):
    """{link kind: GPU pairs} among the GPUs ids names, from `nvidia-smi topo -m` (NV# NVLink; PIX, PXB, PHB, NODE,
    SYS ever farther over PCIe); every GPU where ids are UUIDs; {} where there is no matrix."""
    matrix = {line.split()[0]: line.split()[1:] for line in topo.splitlines() if line.startswith("GPU")}
    gpus = [name for name in matrix if name[3:].isdigit()]
    chosen = [f"GPU{i}" for i in ids if f"GPU{i}" in matrix] if all(i.isdigit() for i in ids) else gpus
    kinds = [matrix[a][gpus.index(b)] if gpus.index(b) < len(matrix[a]) else "?" for a, b in combinations(chosen, 2)]
    return dict(Counter(kinds))
