"""The exact command of each run, as a user would start it: the batch-size rules and the choice of GPUs. Runs
use the harness's own interpreter (torchrun as its -m torch.distributed.run), whatever PATH holds."""
import os
import shlex
import sys

from bench.machine import free_port
from bench.scripts import REPO, SCRIPTS

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def repo_relative(path):
    """Paths inside the repository relative to it (the scripts run there), as a user would type them."""
    path = os.path.abspath(path)
    return os.path.relpath(path, REPO) if os.path.commonpath([path, REPO]) == REPO else path


def visible(gpus):
    """The GPUs a process sees (none on the CPU), numbered as nvidia-smi does unless the user chose an order."""
    order = os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus), "CUDA_DEVICE_ORDER": order}


def commands(run, settings, metrics_path, snapshot_path):
    """[(environment, argv)] of one run: one command, or two for the two "nodes" of 05 on this host.
    B is the per-GPU batch: 02 gets n x B and n GPU ids, every other mode B in each of its n processes."""
    B, n, script, python = run.batch, run.n, SCRIPTS[run.mode], [sys.executable, SCRIPTS[run.mode]]
    batch = n * B if run.mode == "dp" else B  # one process drives 02's n GPUs: its loader yields n x B
    common = ["--batch-size", batch, "--epochs", settings.epochs, "--test-batch-size", settings.test_batch_size,
              "--seed", settings.seed + run.repeat - 1, "--metrics-json", repo_relative(metrics_path)]
    common += ["--max-steps", settings.max_steps] if settings.max_steps else []
    common += ["--synthetic"] if settings.synthetic else ["--data-dir", settings.data_dir]
    # On the CPU the n processes share the host's cores; the scripts' own rule counts processes per node,
    # which would give each of 05's two "nodes" on one host twice its share.
    common += ["--cpu", "--threads", max(1, settings.cores // n)] if settings.cpu else []
    common += list(run.flags)
    torchrun = TORCHRUN + ["--standalone", "--nproc_per_node", n, script]
    accelerator = "cpu" if settings.cpu else "gpu"
    argv = {"single": python, "dp": python + ([] if settings.cpu else ["--gpus", ",".join(map(str, range(n)))]),
            "ddp_launch": torchrun, "ddp_fault_tolerant": torchrun + ["--snapshot", repo_relative(snapshot_path)],
            "ddp_spawn": python + ["--nprocs", n, "--master-port", free_port()],
            "lightning": python + ["--devices", n, "--strategy", "ddp", "--accelerator", accelerator]}
    if run.mode != "ddp_multinode":
        return [(visible(settings.gpus[:n]), [str(a) for a in argv[run.mode] + common])]
    port, half = free_port(), n // 2
    return [(visible(settings.gpus[r * half:(r + 1) * half]), [str(a) for a in python + [
        "-n", 2, "-g", half, "--nr", r, "--master-addr", "127.0.0.1", "--master-port", port] + common]) for r in (0, 1)]


def as_typed(cmds, cpu):
    """As a user types them: python for this interpreter, torchrun; 05's two nodes at once, hence '&'."""
    def one(env, argv):
        text = shlex.join(argv).replace(shlex.join(TORCHRUN), "torchrun").replace(shlex.quote(sys.executable), "python")
        return ("" if cpu else f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} ") + text
    return " & ".join(one(env, argv) for env, argv in cmds)
