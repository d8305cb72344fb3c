"""The five plots of a sweep, each readable on its own: hardware in the title, units on the axes, a legend."""
import os

from matplotlib.figure import Figure  # not pyplot: files only, no display or GUI backend

from bench.outputs import write_atomically
from bench.plan import ideal_speedup
from bench.report import REFERENCE, shares_cores
from bench.family import MODES


def labels(summary):
    """Each row's line: "03 ddp_launch", its global batch rule, [variant] and [B=...], each where they differ."""
    label = summary["mode"].map(lambda m: f"{MODES[m].number} {m}")  # the script's number first: reading order
    for key, form in [("rule", " (global batch {})"), ("variant", " [{}]"), ("per_device_batch", " [B={}]")]:
        if summary[key].nunique() > 1:  # one 100% line, lines of other batch rules: the legend says which
            label += summary[key].map(form.format)
    return label


def draw(path, summary, column, title, ylabel, hardware, xlabel, bars=False, scale=1, ideal=None, empty=""):
    """column x scale against n, a line (or bars) for each of labels()."""
    table = summary.assign(line=labels(summary), y=scale * summary[column]).pivot_table(index="n", columns="line",
                                                                                         values="y")
    colors = "tab20" if table.shape[1] > 10 else None  # the default cycle repeats after 10 lines
    ax = Figure(figsize=(8, 5)).subplots()
    if table.empty:  # pivot_table drops the lines without a value
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", color="0.4")
    elif bars:  # accuracy and time to target at each n are not lines
        table.plot.bar(ax=ax, rot=0, width=0.8, colormap=colors)
    else:
        table.plot(ax=ax, marker="o", xticks=table.index, colormap=colors)
        for label, y in (ideal or {}).items():
            ax.plot(table.index, [y(n) for n in table.index], "k--", alpha=0.6, label=label)
    ax.set(title=f"{title}\n{hardware}", xlabel=xlabel, ylabel=ylabel, ylim=(0, None))
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # outside the axes, so that it never hides a bar or a point
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0, fontsize=9)
    write_atomically(path, lambda tmp: ax.figure.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))


def write_all(out_dir, summary, hardware, settings):
    hardware += " - synthetic data" if settings.synthetic else ""
    target = f"{settings.target_acc:.2%}"
    x01 = summary[(summary["mode"] == REFERENCE) & (summary["n"] == 1) & (summary["variant"] == "base")]
    shared = shares_cores(summary).any()  # as the summary's E(n): the same rule, the same reference
    reference = "1 x 01: n processes share 01's cores" if shared else "n x 01"
    ideal = {f"ideal: {reference} [B={b}]": (lambda n, x=x: ideal_speedup(n, shared) * x)
             for b, x in zip(x01["per_device_batch"], x01["samples_per_s"])}
    efficiency = "X(n) / X(01), n processes on 01's cores" if shared else "X(n) / (n X(01))"
    sharded = [name for name, mode in MODES.items() if mode.sharded]
    full = summary.loc[summary["mode"].isin(sharded) & (summary["n"] == 1), "held_mib"].max()
    shards = " or ".join(MODES[name].number for name in sharded)
    plots = [("throughput.png", "Training throughput", "samples_per_s", "throughput (samples/s, all devices)",
              dict(ideal=ideal)),
             ("efficiency.png", f"Scaling efficiency E(n) = {efficiency}", "efficiency", "efficiency (%)",
              dict(scale=100, ideal={"ideal (100%)": lambda n: 100}, empty="no 01 at n = 1: no baseline")),
             ("time_to_target.png", f"Time to {target} test accuracy (training time)", "time_to_target_s",
              "time to target (s)", dict(bars=True, empty=f"no run reached {target} (synthetic data cannot)")),
             ("accuracy.png", "Final test accuracy (10,000 images)", "test_accuracy", "test accuracy (%)",
              dict(bars=True, scale=100, empty="no run finished")),
             ("memory.png", "Weights, gradients and optimizer state per rank", "held_mib", "held per rank (MiB)",
              dict(ideal={f"each DDP rank (03): a full copy, as {shards} at n = 1": lambda n: full},
                   empty=f"{shards} did not run"))]
    xlabel = "n (processes on the CPU)" if settings.cpu else "n (GPUs)"
    for name, title, column, ylabel, options in plots:
        draw(os.path.join(out_dir, name), summary, column, title, ylabel, hardware, xlabel, **options)
    return [(name, title) for name, title, *_ in plots]
