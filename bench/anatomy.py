"""The anatomy of a step: what a script's ranks move in one training step, and where the step's time goes.

    python bench/anatomy.py 03_ddp_launch.py --nproc 2
    python bench/anatomy.py 10_pipeline_parallel.py --nproc 2 --out anatomy-10 -- --schedule 1f1b

It starts the script as the harness does, with random data unless --data-dir names MNIST's folder, and leaves the
script as it is. tools/copy_hook starts the profiler in every process (bench/measure/anatomy_hook.py). The first
steps are skipped; the next --steps are profiled. DIR gets each rank's trace (Perfetto and chrome://tracing open
it), timeline.png, anatomy.json and env.json, the machine and versions it ran on.

A step is what lies between the ends of two optimizer steps. Its time splits four ways, adding up to it:
compute alone, compute with a collective under way (overlapped), a wait on a collective while every rank waits
(exposed communication), and idle: a wait while another rank still computes, as in a pipeline's bubble.
"""
import gzip
import json
import math
import os
import sys

if not __package__:  # `python bench/anatomy.py`: the package is importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import REPO  # noqa: E402
from bench.commands import commands  # noqa: E402
from bench.family import MODES, by_script  # noqa: E402
from bench.flags import BadArgument, Parser, in_range  # noqa: E402
from bench.machine import environment  # noqa: E402
from bench.outputs import write_atomically, write_json  # noqa: E402
from bench.plan import Run, Settings, device_counts  # noqa: E402
from bench.processes import log_tail, run_processes  # noqa: E402

SKIP = 4  # steps left out before the profiled ones: the first pay for allocation and warm-up
HOOK = os.path.join(REPO, "tools", "copy_hook")
START_MARK = "anatomy: first step starts"  # bench/measure/anatomy_hook.py's
BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "bool": 1,
         "Float": 4, "Double": 8, "BFloat16": 2, "Half": 2, "Long": 8, "Int": 4}
# A rank waits in these; the time is not compute. gloo's own events name their collective: gloo:all_reduce.
WAITS = ("gloo:", "wait_tensor", "c10d::wait", "ProcessGroup::wait")
KINDS = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green", "data": "tab:purple",
         "idle": "0.85"}
PARTS = ("compute_ms", "overlapped_comm_ms", "exposed_comm_ms", "idle_ms")
COLLECTIVE_COLOURS = ["tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "black"]


# ---- Intervals: sorted lists of disjoint (start, end) in microseconds.

def union(spans):
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(s) for s in merged]


def intersect(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def minus(a, b):
    out = []
    for start, end in a:
        for cut_start, cut_end in b:
            if cut_end <= start or cut_start >= end:
                continue
            if cut_start > start:
                out.append((start, cut_start))
            start = max(start, cut_end)
        if start < end:
            out.append((start, end))
    return out


def length(spans):
    return sum(end - start for start, end in spans)


# ---- Reading a trace.

def load_trace(path):
    """The trace's complete events, their times in microseconds since the epoch: ranks on one host line up."""
    with gzip.open(path) as f:
        trace = json.load(f)
    base = trace.get("baseTimeNanoseconds", 0) / 1000
    events = [dict(e, start=e["ts"] + base, end=e["ts"] + base + e.get("dur", 0)) for e in trace["traceEvents"]
              if e.get("ph") == "X"]
    return trace, events


def tensor_bytes(dims, dtype):
    numel = 1
    for d in dims:
        numel *= d
    return numel * BYTES.get(dtype, 4)


def collective(event, group_size):
    """(name, in_bytes, out_bytes) of a collective event, or None: gloo's on the CPU, record_param_comms on NCCL.
    group_size: the ranks of its group, as the all-gather's caller gave it (gloo's event has only the input)."""
    args = event.get("args", {})
    if event["name"].startswith("gloo:"):
        name = event["name"][len("gloo:"):]
        dims, types = args.get("Input Dims") or [[]], args.get("Input type") or ["float"]
        size = tensor_bytes(dims[0], types[0])
        sent, received = {"all_gather": (size, size * group_size), "send": (size, 0), "recv": (0, size),
                          "reduce_scatter": (size, size // group_size)}.get(name, (size, size))
        return name, sent, received
    if event["name"] == "record_param_comms" and "Collective name" in args:
        size = BYTES.get(str(args.get("dtype")), 4)
        return args["Collective name"], args.get("In msg nelems", 0) * size, args.get("Out msg nelems", 0) * size
    return None


def comm_name(event):
    """all_reduce for gloo:all_reduce and for NCCL's kernel ncclDevKernel_AllReduce_Sum_f32_RING_LL; else None."""
    if event["name"].startswith("gloo:"):
        return event["name"][len("gloo:"):]
    if event.get("cat") == "kernel" and "nccl" in event["name"].lower():
        for word in ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "SendRecv", "Send", "Recv"):
            if word in event["name"]:
                return "".join("_" + c.lower() if c.isupper() else c for c in word).lstrip("_")
        return "nccl"
    return None


def group_size(event, events, world_size):
    """An all-gather's group: the output over the input of the c10d call that started it, the last before it."""
    if event["name"] != "gloo:all_gather":
        return world_size
    dims = (event.get("args", {}).get("Input Dims") or [[]])[0]
    calls = [e for e in events if e["name"] == "c10d::_allgather_base_" and e["start"] <= event["start"]
             and (e["args"].get("Input Dims") or [[], []])[1] == dims]
    if not calls:
        return world_size
    out = max(calls, key=lambda e: e["start"])["args"]["Input Dims"][0]
    return math.prod(out) // max(1, math.prod(dims))


def kind_of(name):
    if name.startswith("Optimizer."):
        return "optimizer"
    if name.startswith("enumerate(DataLoader)"):
        return "data"
    if name.startswith("autograd::engine") or "Backward" in name:
        return "backward"
    return None


def rank_parts(events, world_size):
    """One rank's busy spans, its collectives' spans, its step edges and what it moved, from its trace."""
    on_device = [e for e in events if e.get("cat") == "kernel"]
    comm_events = [e for e in events if comm_name(e)]
    if on_device:  # a GPU: its kernels are the compute; the CPU only launches them
        busy = union((e["start"], e["end"]) for e in on_device if not comm_name(e))
    else:
        threads = {e["tid"] for e in events if e.get("cat") == "cpu_op"}
        spans = union((e["start"], e["end"]) for e in events if e["tid"] in threads
                      and e.get("cat") in ("cpu_op", "user_annotation") and e["name"] != START_MARK)
        busy = minus(spans, union((e["start"], e["end"]) for e in events
                                  if e["tid"] in threads and e["name"].startswith(WAITS)))
    marks = [e["start"] for e in events if e["name"] == START_MARK]
    steps = sorted(e["end"] for e in events if e["name"].startswith("Optimizer.step#") and e.get("cat") != "kernel")
    edges, comm = marks[:1] + steps, union((e["start"], e["end"]) for e in comm_events)
    if not on_device:  # the CPU between two ops runs Python: it waits only while a collective is under way
        window = [(edges[0], edges[-1])] if edges else []
        busy = minus(window, intersect(minus(window, busy), comm))
    moved = [(e["start"], collective(e, group_size(e, events, world_size))) for e in comm_events + [
        e for e in events if e["name"] == "record_param_comms"] if collective(e, world_size)]
    return dict(busy=busy, comm=comm, edges=edges, moved=moved, comm_events=comm_events, events=events)


def analyse(out_dir, world_size):
    """anatomy.json's ranks: per step the collectives and the four parts of the time; FLOPs."""
    parts = [rank_parts(load_trace(os.path.join(out_dir, f"trace-rank{r}.json.gz"))[1], world_size)
             for r in range(world_size)]
    ranks = []
    for r, part in enumerate(parts):
        others_busy = union(s for q, other in enumerate(parts) if q != r for s in other["busy"])
        counted = json.load(open(os.path.join(out_dir, f"flops-rank{r}.json")))
        flops = counted["flops_per_step"]
        steps = []
        for a, b in zip(part["edges"], part["edges"][1:]):
            step = [(a, b)]
            busy, comm = intersect(part["busy"], step), intersect(part["comm"], step)
            waiting = minus(step, busy)
            exposed = minus(intersect(waiting, comm), others_busy)  # every rank waits: on the network
            moved = {}
            for when, (name, sent, received) in part["moved"]:
                if a <= when < b:
                    row = moved.setdefault(name, dict(calls=0, in_bytes=0, out_bytes=0))
                    row["calls"] += 1
                    row["in_bytes"] += sent
                    row["out_bytes"] += received
            ms = dict(step_ms=(b - a) / 1000, compute_ms=length(minus(busy, comm)) / 1000,
                      overlapped_comm_ms=length(intersect(busy, comm)) / 1000,
                      exposed_comm_ms=length(exposed) / 1000,
                      idle_ms=(length(waiting) - length(exposed)) / 1000)
            steps.append(dict(collectives=moved, **{k: round(v, 3) for k, v in ms.items()}))
        mean_ms = sum(s["step_ms"] for s in steps) / len(steps)
        ranks.append(dict(rank=r, flops_per_step=flops, flop_per_s=flops / (mean_ms / 1000),
                          step_peak_bytes=counted["step_peak_bytes"], steps=steps))
    return ranks, parts


# ---- The timeline: one row per rank and thread, the profiled steps, coloured by kind.

def painted(part, tid):
    """[(start, end, kind)] of one thread: an event's kind is its own, else its parent's, else forward."""
    edges, stack, out = part["edges"], [], []
    mine = sorted((e for e in part["events"] if e["tid"] == tid and edges[0] <= e["start"] < edges[-1]
                   and e["name"] != START_MARK), key=lambda e: (e["start"], -e.get("dur", 0)))
    for e in mine:
        while stack and stack[-1][0] <= e["start"]:
            stack.pop()
        kind = comm_name(e) or kind_of(e["name"]) or (stack[-1][1] if stack else "forward")
        if not stack or kind != stack[-1][1]:
            out.append((e["start"], e["end"], kind))
        stack.append((e["end"], kind))
    return out


def draw_timeline(path, parts, title):
    from matplotlib.figure import Figure  # not pyplot: a file only
    from matplotlib.patches import Patch
    start = min(p["edges"][0] for p in parts)
    colours, rows = {}, []
    for r, part in enumerate(parts):
        threads = sorted({e["tid"] for e in part["events"] if e.get("cat") in ("cpu_op", "kernel")}, key=str)
        comm_threads = sorted({e["tid"] for e in part["comm_events"]} - set(threads), key=str)
        for t in threads:
            rows.append((f"rank {r}" + (" compute" if comm_threads else ""), part, t))
        rows += [(f"rank {r} comm", part, t) for t in comm_threads]
    ax = Figure(figsize=(11, 1 + 0.5 * len(rows))).subplots()
    for y, (label, part, tid) in enumerate(reversed(rows)):
        edges = part["edges"]
        if not label.endswith(" comm"):  # grey where the rank waits: on another rank, or on a collective
            waiting = minus([(edges[0], edges[-1])], part["busy"])
            ax.broken_barh([((a - start) / 1000, (b - a) / 1000) for a, b in waiting], (y - 0.4, 0.8),
                           color=KINDS["idle"])
        for a, b, kind in painted(part, tid):
            if kind not in KINDS and kind not in colours:
                colours[kind] = COLLECTIVE_COLOURS[len(colours) % len(COLLECTIVE_COLOURS)]
            ax.broken_barh([((a - start) / 1000, (b - a) / 1000)], (y - 0.4, 0.8),
                           color=KINDS.get(kind) or colours[kind])
        for edge in edges:
            ax.axvline((edge - start) / 1000, color="k", lw=0.6, alpha=0.5)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in reversed(rows)])
    legend = {**KINDS, **colours}
    ax.legend(handles=[Patch(color=c, label=k) for k, c in legend.items()], ncol=len(legend), loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if len(rows) < 4 else -0.12), fontsize=8, frameon=False)
    ax.set(title=title, xlabel="ms since the first profiled step began")
    ax.figure.tight_layout()
    write_atomically(path, lambda tmp: ax.figure.savefig(tmp, format="png", dpi=110))


# ---- Running a script under the profiler.

def parser():
    p = Parser(prog="python bench/anatomy.py", description=__doc__.split("\n\n")[0])
    p.add_argument("script", help="a numbered script, such as 03_ddp_launch.py")
    p.add_argument("--nproc", type=in_range(1), default=2, help="ranks, as the harness's n")
    p.add_argument("--steps", type=in_range(1, 50), default=3, help="steps profiled")
    p.add_argument("--batch-size", type=in_range(1), default=64, help="per device, as the harness's B")
    p.add_argument("--out", help="the folder (default anatomy/<script's number>)")
    p.add_argument("--timeout", type=in_range(1.0, kind=float), default=300.0, help="seconds at most")
    p.add_argument("--data-dir", help="MNIST's folder (default: random data, whose 10,000 test images take longest)")
    return p


def measure(mode, n, steps, batch_size, out_dir, script_flags=(), timeout=300.0, gpus=(), data_dir=None):
    """Run the script under the profiler, on the CPU or on gpus[:n]; anatomy.json's object."""
    settings = Settings(gpus=list(gpus[:n]), max_n=n, per_device_batches=[batch_size], epochs=1, epoch_images=0,
                        test_batch_size=1000, seed=1, synthetic=data_dir is None, data_dir=data_dir or "data",
                        target_acc=0.98, timeout=timeout, cores=os.cpu_count() or 1)
    flags = ("--max-steps", str(SKIP + steps + 1), "--log-interval", "0", *script_flags)
    run = Run("base", flags, mode.name, n, batch_size, 1)
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):  # a trace of an earlier run must not pass for this one's
        if name.startswith(("trace-rank", "flops-rank")):
            os.remove(os.path.join(out_dir, name))
    cmds = commands(run, settings, os.path.join(out_dir, "metrics.json"), os.path.join(out_dir, "snapshot.pt"))
    hook = {"PYTHONPATH": os.pathsep.join([HOOK] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
            "ANATOMY_OUT": os.path.abspath(out_dir), "ANATOMY_SKIP": str(SKIP), "ANATOMY_STEPS": str(steps)}
    logs = [os.path.join(out_dir, f"log-{i}.txt") for i in range(len(cmds))]
    code, timed_out = run_processes([({**env, **hook}, argv) for env, argv in cmds], logs, timeout)
    if code or timed_out:
        why = f"timed out after {timeout:.0f} s" if timed_out else f"exit status {code}"
        raise BadArgument(f"{mode.script} failed ({why}):\n{log_tail(logs)}")
    record = json.load(open(os.path.join(out_dir, "metrics.json")))
    ranks = record["world_size"] if mode.launch.group else 1  # 02 is one process however many GPUs it drives
    found, parts = analyse(out_dir, ranks)
    result = dict(script=mode.script, mode=mode.name, world_size=record["world_size"], ranks=ranks,
                  device_type=record["device_type"], backend=record["backend"], per_device_batch=batch_size,
                  global_batch=record["global_batch"], synthetic=record["synthetic"], steps_skipped=SKIP,
                  steps_profiled=steps, script_flags=list(script_flags), torch_version=record.get("torch_version"),
                  per_rank=found)
    write_json(os.path.join(out_dir, "anatomy.json"), result)
    draw_timeline(os.path.join(out_dir, "timeline.png"), parts,
                  f"{mode.script} at n = {n}, {steps} steps, {record['device_type']}")
    for path in [*logs, os.path.join(out_dir, "metrics.json"), os.path.join(out_dir, "snapshot.pt")]:
        if os.path.exists(path):  # 06 alone writes a snapshot
            os.remove(path)
    return result


# ---- run_all.py --anatomy: every mode's step, side by side.

def sweep_n(mode, settings):
    """The sweep's largest n at which the mode runs; on the CPU past the sweep if none (11 at 4): None if not."""
    fits = [n for n in device_counts(settings.max_n) if mode.runs_with(n, settings.cpu)]
    beyond = [n for n in range(settings.max_n + 1, 9) if settings.cpu and mode.runs_with(n, True)]
    return max(fits) if fits else (beyond or [None])[0]


def sweep(modes, settings, out_dir):
    """Each mode's step into out_dir/anatomy/NN and anatomy.png; (a row a mode, what could not be measured)."""
    rows, failed = [], []
    for mode in [MODES[m] for m in modes]:
        n = sweep_n(mode, settings)
        if n is None:
            failed.append(f"{mode.script}'s step ({mode.why})")
            continue
        print(f"the anatomy of {mode.script}'s step at n = {n}", flush=True)
        try:
            data = None if settings.synthetic else settings.data_dir  # the sweep's
            result = measure(mode, n, 3, settings.per_device_batches[-1], os.path.join(out_dir, "anatomy", mode.number),
                             timeout=300.0, gpus=settings.gpus, data_dir=data)
        except BadArgument as e:
            failed.append(f"{mode.script}'s step ({str(e).splitlines()[0]})")
            continue
        steps = [s for rank in result["per_rank"] for s in rank["steps"]]
        row = dict(mode=mode.name, number=mode.number, n=n)
        row.update({key: sum(s[key] for s in steps) / len(steps) for key in ("step_ms", *PARTS)})
        row.update({key: sum(c[key] for s in steps for c in s["collectives"].values()) / len(steps)
                    for key in ("in_bytes", "out_bytes")})
        rows.append(row)
    if rows:
        draw_bars(os.path.join(out_dir, "anatomy.png"), rows)
    return rows, failed


def draw_bars(path, rows):
    """One bar a mode: its mean step on a rank, in its four parts; the bytes a rank hands in and gets out."""
    from matplotlib.figure import Figure
    ax = Figure(figsize=(10, 1 + 0.5 * len(rows))).subplots()
    labels = [f"{r['number']} {r['mode']}, n = {r['n']}" for r in reversed(rows)]
    left = [0.0] * len(rows)
    for part, colour in zip(PARTS, ["tab:blue", "tab:cyan", "tab:red", KINDS["idle"]]):
        widths = [r[part] for r in reversed(rows)]
        ax.barh(labels, widths, left=left, color=colour, label=part[:-3].replace("_", " "))
        left = [a + b for a, b in zip(left, widths)]
    for y, r in enumerate(reversed(rows)):
        ax.text(left[y], y, f"  {r['in_bytes'] / 1e6:.2f} MB in, {r['out_bytes'] / 1e6:.2f} MB out", va="center",
                fontsize=8)
    ax.set(title="One step on a rank: where its time goes, what it moves", xlabel="ms (mean of ranks and steps)",
           xlim=(0, 1.35 * max(left)))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    write_atomically(path, lambda tmp: ax.figure.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))


def summary_lines(result):
    lines = [f"{result['script']}: {result['ranks']} rank(s), global batch {result['global_batch']}"]
    for rank in result["per_rank"]:
        first = rank["steps"][-1]
        moved = ", ".join(f"{name} {c['calls']}x in {c['in_bytes']:,} B out {c['out_bytes']:,} B"
                          for name, c in first["collectives"].items()) or "nothing"
        lines.append(f"  rank {rank['rank']}: step {first['step_ms']:.1f} ms = compute {first['compute_ms']:.1f} + "
                     f"overlapped {first['overlapped_comm_ms']:.1f} + exposed {first['exposed_comm_ms']:.1f} + "
                     f"idle {first['idle_ms']:.1f}; moved {moved}; allocated at most "
                     f"{rank['step_peak_bytes'] / 1e6:.1f} MB above the step's start")
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    try:
        args = parser().parse_args(ours)
        script = os.path.basename(args.script)
        if script not in {m.script for m in MODES.values()}:
            raise BadArgument(f"{args.script} is not one of the family's scripts: {', '.join(m.script for m in MODES.values())}")
        mode = by_script(script)
        if not mode.runs_with(args.nproc, True) and mode.launch.group:
            raise BadArgument(f"{script} cannot run at --nproc {args.nproc}: {mode.why}")
        import torch
        cpu = "--cpu" in theirs or torch.cuda.device_count() < args.nproc
        out = args.out or os.path.join("anatomy", script[:2])
        gpus = [] if cpu else [str(i) for i in range(args.nproc)]
        result = measure(mode, args.nproc, args.steps, args.batch_size, out, [f for f in theirs if f != "--cpu"],
                         args.timeout, gpus, args.data_dir)
        write_json(os.path.join(out, "env.json"), environment(REPO, [(g, "") for g in gpus]))
    except BadArgument as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary_lines(result)))
    print(f"wrote {out}/anatomy.json, env.json, timeline.png and trace-rank*.json.gz (open them in "
          "https://ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
