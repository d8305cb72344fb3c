"""Each run's exact command as a user would start it, with the harness's own interpreter whatever PATH holds."""
import os
import shlex
import sys

from bench.machine import free_port
from bench.plan import steps_per_epoch
from bench.family import MODES, REPO

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def repo_relative(path):
    """Paths inside the repository relative to it (the scripts run there), as a user would type them."""
    path = os.path.abspath(path)
    return os.path.relpath(path, REPO) if os.path.commonpath([path, REPO]) == REPO else path


def visible(gpus):
    """The GPUs a process sees (none on the CPU), numbered as nvidia-smi does unless the user chose an order."""
    order = os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus), "CUDA_DEVICE_ORDER": order}


def launch(mode, script_path, n=None, launcher=()):
    """The command up to the script's flags; n None: its default count (torchrun: 1); launcher: torchrun's options."""
    if mode.launch.torchrun:
        return [*TORCHRUN, "--standalone", "--nproc_per_node", str(n or 1), *map(str, launcher), str(script_path)]
    count = [mode.launch.count_flag, str(n)] if n and mode.launch.count_flag else []
    return [sys.executable, str(script_path), *count]


def commands(run, settings, metrics_path, snapshot_path):
    """[(environment, argv)] of one run: one command, or two for the two "nodes" of 05 on this host."""
    mode, n = MODES[run.mode], run.n
    common = ["--batch-size", mode.batch.loader_batch(run.per_device_batch, n), "--epochs", settings.epochs,
              "--test-batch-size", settings.test_batch_size, "--seed", settings.seed + run.repeat - 1,
              "--metrics-json", repo_relative(metrics_path)]
    common += ["--max-steps", steps_per_epoch(run, settings)] if settings.epoch_images else []
    common += ["--synthetic"] if settings.synthetic else ["--data-dir", settings.data_dir]
    # On the CPU n processes share the host's cores; the scripts count per node, giving 05's two "nodes" twice that.
    common += ["--cpu", "--threads", max(1, settings.cores // n)] if settings.cpu else []
    common += ["--snapshot", repo_relative(snapshot_path)] if mode.snapshot else []
    common += list(run.flags)
    argv = launch(mode, mode.script, n) + mode.launch.flags(n, settings)
    argv += [mode.launch.port_flag, free_port()] if mode.launch.port_flag else []  # two runs never share one
    nodes = mode.launch.nodes
    if nodes == 1:  # on Windows torchrun's store asks for libuv, which PyTorch there lacks
        libuv = {"USE_LIBUV": "0"} if mode.launch.torchrun and os.name == "nt" else {}
        return [({**visible(settings.gpus[:n]), **libuv}, [str(a) for a in argv + common])]
    port, each = free_port(), n // nodes
    return [(visible(settings.gpus[r * each:(r + 1) * each]), [str(a) for a in argv + [
        "-n", nodes, "-g", each, "--nr", r, "--master-addr", "127.0.0.1", "--master-port", port] + common])
        for r in range(nodes)]


def as_typed(cmds, cpu):
    """As a user types them: python for this interpreter, torchrun; 05's two nodes at once, hence '&'."""
    text = " & ".join(("" if cpu else f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} ") + shlex.join(argv)
                      for env, argv in cmds)
    return text.replace(shlex.join(TORCHRUN), "torchrun").replace(shlex.quote(sys.executable), "python")
