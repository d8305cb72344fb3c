"""CUDA's defaults, on the CPU. On PYTHONPATH (helpers.as_on_cuda), in every process of a run, the CPU takes the
paths that PyTorch takes by default on a CUDA GPU where they differ from the CPU's own:

- The optimizers' foreach path. On CUDA, torch.optim updates all parameters through one list of tensors; on the CPU,
  one tensor at a time. torch decides in _default_to_fused_or_foreach, from the devices that
  _get_foreach_kernels_supported_devices lists. Here that list holds the CPU too, so torch's own code decides for
  the CPU what it decides for CUDA, with the same parameter types.
- cuDNN's convolution backward is not deterministic: its sums run in any order, so a weight gradient differs by
  rounding from call to call, unless torch.backends.cudnn.deterministic is set. Here each process adds its own
  rounding-sized noise (2^-23, float32's) to every convolution's weight gradient, unless that flag is set.
- Reading a tensor on the host (item, tolist, cpu, numpy) waits for the GPU, and a host-to-device copy waits for
  the host unless non_blocking=True. Here each such call made by a numbered script's own lines is counted, by the
  function that made it.

Each process writes to $AS_ON_CUDA_LOG one JSON line as it exits: {"pid", "script", "reads": {function: count},
"copies": {function: [blocking, non-blocking]}, "conv_grads": {"exact": count, "rounded": count}}. A test knows from
it that the hook ran in every process. A hook later on PYTHONPATH (tests/integration/rank_weights) runs too: Python
imports only the first sitecustomize."""
import atexit
import collections
import json
import os
import pathlib
import re
import runpy
import sys

# tools/startup_hook.py runs the next sitecustomize.py on PYTHONPATH first: Python imports only the first.
runpy.run_path(str(pathlib.Path(__file__).resolve().parents[2] / "tools" / "startup_hook.py"))["chain"](__file__)

if os.environ.get("AS_ON_CUDA_LOG"):
    import torch
    import torch.nn.functional as F
    import torch.optim.optimizer as optimizer  # torch.optim deletes its `optimizer` name: import it as one
    import torch.utils._foreach_utils as foreach_utils

    # The foreach path: the CPU on CUDA's list (the optimizers read it through torch.optim.optimizer's name).
    real_devices = foreach_utils._get_foreach_kernels_supported_devices

    def foreach_devices():
        return [*real_devices(), "cpu"]

    foreach_utils._get_foreach_kernels_supported_devices = foreach_devices
    optimizer._get_foreach_kernels_supported_devices = foreach_devices

    # cuDNN's backward: rounding noise on the weight gradient, from a generator of this process's own (the global
    # one draws the dropout masks, which the scripts keep equal on every rank).
    noise = torch.Generator().manual_seed(os.getpid())
    conv_grads = collections.Counter()

    class Rounding(torch.autograd.Function):
        @staticmethod
        def forward(ctx, weight):
            return weight.view_as(weight)

        @staticmethod
        def backward(ctx, grad):
            if torch.backends.cudnn.deterministic or torch.are_deterministic_algorithms_enabled():
                conv_grads["exact"] += 1
                return grad
            conv_grads["rounded"] += 1
            jitter = torch.randn(grad.shape, generator=noise, dtype=grad.dtype)
            return grad * (1 + 2.0 ** -23 * jitter)

    real_conv2d = F.conv2d

    def conv2d(input, weight, *args, **kwargs):
        if weight.requires_grad and type(weight) in (torch.Tensor, torch.nn.Parameter):  # not a DTensor
            weight = Rounding.apply(weight)
        return real_conv2d(input, weight, *args, **kwargs)

    F.conv2d = conv2d  # nn.Conv2d calls F.conv2d by this name

    # Host reads and batch copies, by the numbered script's function that made them.
    NUMBERED = re.compile(r"\d\d_\w+\.py$")
    reads, copies = collections.Counter(), collections.defaultdict(lambda: [0, 0])

    def caller():
        frame = sys._getframe(2)
        return frame.f_code.co_name if NUMBERED.search(frame.f_code.co_filename) else None

    def counted(name):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            function = caller()
            if function:
                reads[function] += 1
            return real(self, *args, **kwargs)
        setattr(torch.Tensor, name, read)

    for name in ["item", "tolist", "cpu", "numpy"]:
        counted(name)
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        function = caller()
        if function:
            copies[function][bool(kwargs.get("non_blocking"))] += 1
        return real_to(self, *args, **kwargs)

    torch.Tensor.to = to

    def report():
        line = dict(pid=os.getpid(), script=os.path.basename(sys.argv[0]) if sys.argv else "", reads=reads,
                    copies=copies, conv_grads=conv_grads)
        with open(os.environ["AS_ON_CUDA_LOG"], "a") as log:
            log.write(json.dumps(line) + "\n")

    atexit.register(report)
