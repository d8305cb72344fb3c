"""01's training step at batch 64 in three forms: eager, the model compiled, and the whole step as one CUDA graph.

    python -m bench.measure.step_forms --json forms.json                  # a GPU: the three forms and the check
    python -m bench.measure.step_forms --cpu --steps 10 --json forms.json  # the CPU: eager and compile

Every form starts from the same weights and trains on the same synthetic batches. Its warm-up steps come first,
with compilation or capture, and stay outside the timed window. The device is synchronised before each clock
read (01's clock). The graph form records forward, loss, backward and Adadelta's update once, then replays them;
it needs CUDA and is skipped elsewhere, with one line saying so.

After the timing, a check: the captured step must give the eager step's update, to float tolerance, before and
after a StepLR step. The graph reads the learning rate from a tensor; a float would be baked in at capture.
Exit status 1 when that check fails or a form cannot run.
"""
import argparse
import copy
import sys
import traceback
import warnings

import torch
import torch.nn.functional as F

from bench.family import load_script
from bench.outputs import write_json

FORMS = ("eager", "compile", "graph")
BATCH = 64  # 01's default --batch-size
BATCHES = 16  # distinct synthetic batches, used in turn by every form
LR, GAMMA = 1.0, 0.7  # 01's --lr and its StepLR's gamma
SIDE_STREAM_STEPS = 3  # PyTorch's docs warm a step up on a side stream this many times before capturing it
# The check: steps before and after the scheduler's step. Float tolerance: the forms run the same kernels; only
# the update's last rounding differs (lr times delta, then an add, against one add with alpha).
CHECK_STEPS = 2
RTOL, ATOL = 1e-4, 1e-6


def train_step(model, optimizer, inputs, labels):
    """01's training step, as train_epoch has it: the same lines in every form."""
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(inputs), labels)
    loss.backward()
    optimizer.step()


def capturable_adadelta(model, lr):
    """Adadelta whose update can be captured: its state stays on the GPU (capturable). The learning rate is a
    tensor, so a scheduler's fill_ reaches the graph; a float would be a constant in it, and StepLR would change
    nothing the graph does."""
    device = next(model.parameters()).device
    return torch.optim.Adadelta(model.parameters(), lr=torch.tensor(lr, device=device), capturable=True)


def captured_step(model, first_batches):
    """The whole step recorded in one CUDA graph, as PyTorch's docs on whole-network capture show. Returns
    step(inputs, labels), which replays it, and its optimizer (for a scheduler).

    The first batches train for real, on a side stream: capture needs kernels and memory chosen already, and
    must not meet the default stream's pending work."""
    optimizer = capturable_adadelta(model, LR)
    static_inputs = torch.empty_like(first_batches[0][0])
    static_labels = torch.empty_like(first_batches[0][1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for inputs, labels in first_batches:
            static_inputs.copy_(inputs)
            static_labels.copy_(labels)
            train_step(model, optimizer, static_inputs, static_labels)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # On the warm-up's stream, whose library handles are made already. zero_grad(set_to_none) is inside: the
    # backward then makes the gradients in the graph's own memory, where each replay writes them.
    with torch.cuda.graph(graph, stream=side):
        train_step(model, optimizer, static_inputs, static_labels)

    def step(inputs, labels):
        static_inputs.copy_(inputs)  # the graph reads its inputs from these two tensors only
        static_labels.copy_(labels)
        graph.replay()
    return step, optimizer


def synthetic_batches(device, seed=1):
    """BATCHES random MNIST-shaped batches, made once: every form trains on these, in this order."""
    rng = torch.Generator().manual_seed(seed)
    images = torch.randn(BATCHES * BATCH, 1, 28, 28, generator=rng)
    labels = torch.randint(0, 10, (BATCHES * BATCH,), generator=rng)
    return [(images[i:i + BATCH].to(device), labels[i:i + BATCH].to(device))
            for i in range(0, BATCHES * BATCH, BATCH)]


def largest_difference(model, reference):
    """The largest absolute difference of two models' weights, and whether each tensor is within tolerance."""
    pairs = list(zip(model.state_dict().values(), reference.state_dict().values()))
    close = all(torch.allclose(mine, theirs, rtol=RTOL, atol=ATOL) for mine, theirs in pairs)
    return max((mine - theirs).abs().max().item() for mine, theirs in pairs), close


def check_capture(m01, batches):
    """The captured step against 01's eager one, from the same weights on the same batches: CHECK_STEPS steps,
    a StepLR step on each side, CHECK_STEPS more at the new learning rate. Dropout is off here, since the two
    would draw other random masks."""
    device = batches[0][0].device
    torch.manual_seed(1)
    eager = m01.Net(dropout=False).to(device)
    captured = copy.deepcopy(eager)
    eager_optimizer = torch.optim.Adadelta(eager.parameters(), lr=LR)  # 01's optimizer, as 01 makes it
    step, optimizer = captured_step(captured, batches[:SIDE_STREAM_STEPS])
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=GAMMA) for o in (eager_optimizer, optimizer)]
    for inputs, labels in batches[:SIDE_STREAM_STEPS]:  # what the captured model trained on before its capture
        train_step(eager, eager_optimizer, inputs, labels)
    results = {}
    for phase, first in (("before", SIDE_STREAM_STEPS), ("after", SIDE_STREAM_STEPS + CHECK_STEPS)):
        if phase == "after":
            with warnings.catch_warnings():  # a replay never calls optimizer.step(), which StepLR watches for
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")
                for scheduler in schedulers:
                    scheduler.step()
        for inputs, labels in batches[first:first + CHECK_STEPS]:
            train_step(eager, eager_optimizer, inputs, labels)
            step(inputs, labels)
        difference, close = largest_difference(captured, eager)
        results[phase] = dict(lr=float(optimizer.param_groups[0]["lr"]), largest_difference=difference,
                              within_tolerance=close)
    return dict(steps_each_side=CHECK_STEPS, rtol=RTOL, atol=ATOL, **results,
                matches=results["before"]["within_tolerance"] and results["after"]["within_tolerance"])


def form_step(form, m01, device, batches, warmup):
    """step(inputs, labels) of one form, its model made from the seed; the first warm-up batches it needs."""
    torch.manual_seed(1)
    model = m01.Net().to(device)  # dropout on, as 01 trains
    if form == "graph":
        step, _ = captured_step(model, batches[:SIDE_STREAM_STEPS])
        return step, warmup - SIDE_STREAM_STEPS  # the side stream's steps were warm-up steps
    optimizer = torch.optim.Adadelta(model.parameters(), lr=LR)
    compiled = torch.compile(model) if form == "compile" else model  # compiled on its first call, in warm-up
    return (lambda inputs, labels: train_step(compiled, optimizer, inputs, labels)), warmup


def measure(form, m01, device, batches, warmup, steps):
    """samples/s of one form over `steps` steps, and the seconds its warm-up took (compilation, capture)."""
    started = m01.clock(device)
    step, left = form_step(form, m01, device, batches, warmup)
    for i in range(warmup - left, warmup):
        step(*batches[i % BATCHES])
    t0 = m01.clock(device)  # waits for the warm-up's work: none of it is timed
    for i in range(warmup, warmup + steps):
        step(*batches[i % BATCHES])
    seconds = m01.clock(device) - t0  # waits for the timed steps to finish on the device
    return dict(samples_per_s=steps * BATCH / seconds, step_ms=seconds / steps * 1e3, warmup_s=t0 - started)


def why_not(form, device):
    """Why a form cannot run on this device, or None."""
    if form == "graph" and device.type != "cuda":
        return f"needs CUDA (a CUDA graph replays recorded GPU work; this run is on {device.type})"
    return None


def main(argv=None):
    m01 = load_script()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="the CPU even where there is a GPU (the graph is skipped)")
    p.add_argument("--forms", default=",".join(FORMS), help=f"which, comma-separated (default {','.join(FORMS)})")
    p.add_argument("--warmup", type=m01.in_range(SIDE_STREAM_STEPS), default=10,
                   help=f"untimed steps per form, at least {SIDE_STREAM_STEPS} (default 10)")
    p.add_argument("--steps", type=m01.in_range(1), default=500, help="timed steps per form (default 500)")
    p.add_argument("--json", type=m01.writable, metavar="PATH", help="write the results here")
    args = p.parse_args(argv)
    forms = args.forms.split(",")
    if set(forms) - set(FORMS):
        p.error(f"--forms: {', '.join(sorted(set(forms) - set(FORMS)))} is none of {', '.join(FORMS)}")
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    device = torch.device("cpu") if args.cpu or accelerator is None else accelerator
    batches = synthetic_batches(device)
    rows = {form: run_form(form, m01, device, batches, args) for form in forms}
    check = run_check(m01, device, batches)
    report(rows, check, device, args)
    if args.json:
        write_json(args.json, dict(batch_size=BATCH, warmup=args.warmup, steps=args.steps, device=device.type,
                                   device_name=torch.cuda.get_device_name() if device.type == "cuda" else device.type,
                                   torch_version=torch.__version__, cuda_version=torch.version.cuda, forms=rows,
                                   capture_check=check, argv=sys.argv if argv is None else argv))
    failed = any("error" in row for row in [*rows.values(), check]) or check.get("matches") is False
    return 1 if failed else 0


def failure(error):
    """An error's row: its last line, and its traceback on stderr for the log."""
    traceback.print_exc()
    return dict(error=(str(error).strip() or type(error).__name__).splitlines()[-1])


def said(row):
    """What a row without figures says: why it was skipped, or its error."""
    return f"skipped: {row['skipped']}" if "skipped" in row else f"error: {row['error']}"


def run_form(form, m01, device, batches, args):
    """One form's row: its measurement, why it was skipped, or its error (a compiler missing, say)."""
    if why_not(form, device):
        return dict(skipped=why_not(form, device))
    try:
        return measure(form, m01, device, batches, args.warmup, args.steps)
    except Exception as e:  # this form's row says so; the other forms still run
        return failure(e)


def run_check(m01, device, batches):
    """The capture check after the timing, with cuDNN's deterministic kernels: the same ones in both forms."""
    if why_not("graph", device):
        return dict(skipped=why_not("graph", device))
    deterministic = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        return check_capture(m01, batches)
    except Exception as e:
        return failure(e)
    finally:
        torch.backends.cudnn.deterministic = deterministic  # as it was


def report(rows, check, device, args):
    """The printed table: one row per form, against eager."""
    print(f"01's training step at batch {BATCH} on {device}: {args.steps} timed steps after {args.warmup} warm-up "
          f"steps, on the same {BATCHES} batches")
    eager = rows.get("eager", {}).get("samples_per_s")
    print(f"{'form':<8} {'samples/s':>11} {'vs eager':>9} {'ms/step':>8} {'warm-up s':>10}")
    for form, row in rows.items():
        if "samples_per_s" not in row:
            print(f"{form:<8} {said(row)}")
            continue
        versus = f"{row['samples_per_s'] / eager:.2f}x" if eager else "-"
        print(f"{form:<8} {row['samples_per_s']:>11,.0f} {versus:>9} {row['step_ms']:>8.3f} {row['warmup_s']:>10.1f}")
    if "matches" not in check:
        print(f"capture check: {said(check)}")
        return
    verdict = "equals" if check["matches"] else "DIFFERS FROM"
    print(f"capture check: the captured update {verdict} the eager one (lr {check['before']['lr']:.2f}, then "
          f"{check['after']['lr']:.2f} after StepLR; largest difference {check['before']['largest_difference']:.1e}, "
          f"then {check['after']['largest_difference']:.1e}; rtol {RTOL}, atol {ATOL})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
