"""01's training step at batch 64, timed in three forms: eager, compiled, and captured whole as one CUDA graph.

    python -m bench.measure.step_forms --json forms.json                  # a GPU: the three forms and the check
    python -m bench.measure.step_forms --cpu --steps 10 --json forms.json  # the CPU: eager and compile

Every form starts from the same weights and synthetic batches; warm-up, with compilation or capture, is untimed;
01's clock synchronises the device. Without CUDA, one line skips the graph. A check follows: the captured update
must equal the eager one before and after a StepLR step. Exit status 1 when the check fails or a form cannot run.
"""
import argparse
import copy
import sys
import traceback
import warnings
from functools import partial

import torch

from bench.family import load_script
from bench.outputs import write_json

FORMS = ("eager", "compile", "graph")
BATCH = 64  # 01's default --batch-size
BATCHES = 16  # distinct synthetic batches, used in turn by every form
LR, GAMMA = 1.0, 0.7  # 01's --lr and its StepLR's gamma
SIDE_STREAM_STEPS = 3  # warm-up steps on a side stream before capture, as PyTorch's docs do
CHECK_STEPS = 2  # the check's steps on each side of the scheduler's step
RTOL, ATOL = 1e-4, 1e-6  # the same kernels: only the update's last rounding differs


def train_step(model, optimizer, inputs, labels):
    optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(inputs), labels).backward()
    optimizer.step()


def capturable_adadelta(model, lr):
    """Adadelta that a graph can capture: state on the GPU, lr a tensor (a float would be baked in)."""
    device = next(model.parameters()).device
    return torch.optim.Adadelta(model.parameters(), lr=torch.tensor(lr, device=device), capturable=True)


def captured_step(model, first_batches):
    """The step as one CUDA graph, after PyTorch's whole-network capture: its replay and its optimizer."""
    optimizer = capturable_adadelta(model, LR)
    static_inputs, static_labels = (torch.empty_like(t) for t in first_batches[0])
    side = torch.cuda.Stream()  # warm-up and capture meet none of the default stream's pending work
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for inputs, labels in first_batches:  # real steps, so capture finds kernels and memory chosen
            static_inputs.copy_(inputs)
            static_labels.copy_(labels)
            train_step(model, optimizer, static_inputs, static_labels)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # set_to_none: the backward makes gradients in the graph's memory
        train_step(model, optimizer, static_inputs, static_labels)

    def step(inputs, labels):
        static_inputs.copy_(inputs)  # the graph reads its inputs from these two tensors only
        static_labels.copy_(labels)
        graph.replay()
    return step, optimizer


def synthetic_batches(device):
    rng = torch.Generator().manual_seed(1)
    images = torch.randn(BATCHES, BATCH, 1, 28, 28, generator=rng).to(device)
    return list(zip(images, torch.randint(0, 10, (BATCHES, BATCH), generator=rng).to(device)))


def check_capture(m01, batches):
    """The captured step against the eager one: the same weights, batches and cuDNN kernels, no dropout."""
    deterministic = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        torch.manual_seed(1)
        eager = m01.Net(dropout=False).to(batches[0][0].device)
        captured = copy.deepcopy(eager)
        eager_optimizer = torch.optim.Adadelta(eager.parameters(), lr=LR)  # as 01 makes it
        step, optimizer = captured_step(captured, batches[:SIDE_STREAM_STEPS])
        for inputs, labels in batches[:SIDE_STREAM_STEPS]:  # what the captured model trained on before its capture
            train_step(eager, eager_optimizer, inputs, labels)
        results = {}
        for phase, first in (("before", SIDE_STREAM_STEPS), ("after", SIDE_STREAM_STEPS + CHECK_STEPS)):
            if phase == "after":
                with warnings.catch_warnings(action="ignore"):  # a new StepLR warns: no optimizer.step() yet
                    for o in (eager_optimizer, optimizer):
                        torch.optim.lr_scheduler.StepLR(o, 1, GAMMA).step()
            for inputs, labels in batches[first:first + CHECK_STEPS]:
                train_step(eager, eager_optimizer, inputs, labels)
                step(inputs, labels)
            pairs = list(zip(captured.state_dict().values(), eager.state_dict().values()))
            results[phase] = dict(lr=float(optimizer.param_groups[0]["lr"]),
                                  largest_difference=max((a - b).abs().max().item() for a, b in pairs),
                                  within_tolerance=all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in pairs))
        return dict(steps_each_side=CHECK_STEPS, rtol=RTOL, atol=ATOL, **results,
                    matches=all(result["within_tolerance"] for result in results.values()))
    finally:
        torch.backends.cudnn.deterministic = deterministic


def measure(form, m01, device, batches, warmup, steps):
    started = m01.clock(device)
    torch.manual_seed(1)
    model = m01.Net().to(device)  # dropout on, as 01 trains
    if form == "graph":
        step, _ = captured_step(model, batches[:SIDE_STREAM_STEPS])  # its side stream took the first warm-up steps
    else:
        optimizer = torch.optim.Adadelta(model.parameters(), lr=LR)
        step = partial(train_step, torch.compile(model) if form == "compile" else model, optimizer)  # warm-up compiles
    for i in range(SIDE_STREAM_STEPS if form == "graph" else 0, warmup + steps):
        if i == warmup:
            t0 = m01.clock(device)  # waits for the warm-up's work: none of it is timed
        step(*batches[i % BATCHES])
    seconds = m01.clock(device) - t0
    return dict(samples_per_s=steps * BATCH / seconds, step_ms=seconds / steps * 1e3, warmup_s=t0 - started)


def row(form, device, work, *args):
    if form == "graph" and device.type != "cuda":
        return dict(skipped=f"needs CUDA (a CUDA graph replays recorded GPU work; this run is on {device.type})")
    try:
        return work(*args)
    except Exception as e:  # this row says so; the other forms still run
        traceback.print_exc()
        return dict(error=(str(e).strip() or type(e).__name__).splitlines()[-1])


def main(argv=None):
    m01 = load_script()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="the CPU even where there is a GPU (the graph is skipped)")
    p.add_argument("--forms", type=lambda text: text.split(","), default=FORMS, help="comma-separated (default: all)")
    p.add_argument("--warmup", type=m01.in_range(SIDE_STREAM_STEPS), default=10,
                   help=f"untimed steps per form, at least {SIDE_STREAM_STEPS} (default 10)")
    p.add_argument("--steps", type=m01.in_range(1), default=500, help="timed steps per form (default 500)")
    p.add_argument("--json", type=m01.writable, metavar="PATH", help="write the results here")
    args = p.parse_args(argv)
    if unknown := set(args.forms) - set(FORMS):
        p.error(f"--forms: {', '.join(sorted(unknown))} is none of {', '.join(FORMS)}")
    device = (not args.cpu and torch.accelerator.current_accelerator(check_available=True)) or torch.device("cpu")
    batches = synthetic_batches(device)
    rows = {f: row(f, device, measure, f, m01, device, batches, args.warmup, args.steps) for f in args.forms}
    check = row("graph", device, check_capture, m01, batches)
    print(f"01's training step, batch {BATCH}, on {device}: {args.warmup} warm-up steps, then {args.steps} timed")
    print(f"{'form':<8} {'samples/s':>11} {'vs eager':>9} {'ms/step':>8} {'warm-up s':>10}")
    eager = rows.get("eager", {}).get("samples_per_s")
    for name, r in [*rows.items(), ("capture check:", check)]:  # figures, the check's verdict, or why not
        if "samples_per_s" in r:
            versus = f"{r['samples_per_s'] / eager:.2f}x" if eager else "-"
            print(f"{name:<8} {r['samples_per_s']:>11,.0f} {versus:>9} {r['step_ms']:>8.3f} {r['warmup_s']:>10.1f}")
        elif "matches" in r:
            print(f"{name} the captured update {'equals' if r['matches'] else 'DIFFERS FROM'} the eager one; "
                  f"before and after StepLR: lr {r['before']['lr']:.2f}, {r['after']['lr']:.2f}; largest difference "
                  f"{r['before']['largest_difference']:.1e}, {r['after']['largest_difference']:.1e}", flush=True)
        else:
            print(f"{name:<8} {', '.join(f'{key}: {text}' for key, text in r.items())}")
    if args.json:
        write_json(args.json, dict(batch_size=BATCH, warmup=args.warmup, steps=args.steps, device=device.type,
                                   device_name=torch.cuda.get_device_name() if device.type == "cuda" else device.type,
                                   torch_version=torch.__version__, cuda_version=torch.version.cuda, forms=rows,
                                   capture_check=check, argv=sys.argv if argv is None else argv))
    return int(any("error" in r for r in [*rows.values(), check]) or check.get("matches") is False)


if __name__ == "__main__":
    sys.exit(main())
