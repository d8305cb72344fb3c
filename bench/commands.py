"""The exact command of each run, as a user would start it: the batch-size rules and the choice of GPUs.

Every run uses the interpreter that runs the harness (sys.executable), and torchrun as `python -m
torch.distributed.run` of that interpreter, whatever `python` or `torchrun` on PATH may be.
"""
import os
import shlex
import sys

from bench.machine import free_port
from bench.scripts import REPO, SCRIPTS

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def for_scripts(path):
    """Paths inside the repository relative to it (the scripts run there), as a user would type them."""
    path = os.path.abspath(path)
    return os.path.relpath(path, REPO) if os.path.commonpath([path, REPO]) == REPO else path


def commands(run, settings, metrics_path, snapshot_path):
    """[(environment, argv)] of one run: one entry, or two for the two "nodes" of 05.

    B is the per-GPU batch: 02 gets n*B and n GPU ids, every other mode B in each of its n processes.
    """
    B, n, script = run.batch, run.n, SCRIPTS[run.mode]
    common = ["--epochs", settings.epochs, "--test-batch-size", settings.test_batch_size,
              "--seed", settings.seed + run.repeat - 1, "--metrics-json", for_scripts(metrics_path)]
    common += ["--max-steps", settings.max_steps] if settings.max_steps else []
    common += ["--synthetic"] if settings.synthetic else ["--data-dir", settings.data_dir]
    # On the CPU the n processes share one host's cores; the scripts' own rule counts processes per node,
    # which for 05's two "nodes" on one host would give each twice its share.
    common += ["--cpu", "--threads", max(1, settings.cores // n)] if settings.cpu else []
    common += list(run.flags)
    python, batch = [sys.executable, script], ["--batch-size", B]
    argvs = {
        "single": python + batch,
        "dp": python + ["--batch-size", n * B] + ([] if settings.cpu else ["--gpus", ",".join(map(str, range(n)))]),
        "ddp_launch": TORCHRUN + ["--standalone", "--nproc_per_node", n, script] + batch,
        "ddp_spawn": python + ["--nprocs", n, "--master-port", free_port()] + batch,
        "ddp_fault_tolerant": TORCHRUN + ["--standalone", "--nproc_per_node", n, script] + batch
        + ["--snapshot", for_scripts(snapshot_path)],
        "lightning": python + ["--devices", n, "--strategy", "ddp", "--accelerator", "cpu" if settings.cpu else "gpu"]
        + batch}
    devices = settings.gpus[:n]
    if run.mode != "ddp_multinode":
        return [(visible(devices), [str(a) for a in argvs[run.mode] + common])]
    port, half = free_port(), n // 2
    return [(visible(devices[r * half:(r + 1) * half]),
             [str(a) for a in python + ["-n", 2, "-g", half, "--nr", r, "--master-addr", "127.0.0.1",
                                        "--master-port", port] + batch + common]) for r in (0, 1)]


def visible(gpus):
    """The GPUs a run sees (none on the CPU), numbered as nvidia-smi does unless the user chose an order."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus), "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")}


def shown(cmds, cpu):
    """The commands as a user types them: python for this interpreter, torchrun for its torch.distributed.run;
    05's two nodes run at the same time, hence '&'."""
    def one(env, argv):
        text = shlex.join(argv).replace(shlex.join(TORCHRUN), "torchrun").replace(shlex.quote(sys.executable), "python")
        return ("" if cpu else f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} ") + text
    return " & ".join(one(env, argv) for env, argv in cmds)
