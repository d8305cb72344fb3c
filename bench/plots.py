"""The four plots of a sweep, each readable on its own: hardware in the title, units on the axes, a legend."""
import os

import matplotlib

matplotlib.use("Agg")  # files only: works on machines without a display
import matplotlib.pyplot as plt  # noqa: E402

from bench.files import write_atomically  # noqa: E402
from bench.scripts import LABELS  # noqa: E402


def series(summary, column, scale=1):
    """column x scale as a table: one row per n, one column per line (mode, and variant and batch when several)."""
    many = [c for c in ("variant", "batch") if summary[c].nunique() > 1]
    label = summary["mode"].map(LABELS) + summary[many].astype(str).apply(lambda r: "".join(f" [{v}]" for v in r)
                                                                           if many else "", axis=1)
    table = summary.assign(line=label, y=scale * summary[column]).pivot_table(index="n", columns="line", values="y",
                                                                             sort=False)
    return table.dropna(axis=1, how="all").sort_index(axis=1)  # labels start 01, 02, ...: reading order


def draw(summary, column, title, ylabel, path, hardware, xlabel, bars=False, scale=1, ideal=None, empty="no data"):
    table = series(summary, column, scale)
    fig, ax = plt.subplots(figsize=(8, 5))
    if table.empty:
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", color="0.4")
    elif bars:  # accuracy and time to target at each n are not lines
        table.plot.bar(ax=ax, rot=0, width=0.8)
    else:
        table.plot(ax=ax, marker="o", xticks=table.index)
    if ideal is not None and not table.empty:
        ideal(ax, table.index)
    ax.set(title=f"{title}\n{hardware}", xlabel=xlabel, ylabel=ylabel)
    ax.title.set_fontsize(11)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # outside the axes, so that it never hides a bar or a point
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0, fontsize=9)
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)


def write_all(out_dir, summary, hardware, settings):
    """[(file, title)] of the plots written."""
    xlabel = "n (processes on the CPU)" if settings.cpu else "n (GPUs)"
    hardware += " - synthetic data" if settings.synthetic else ""
    x01 = summary[(summary["mode"] == "single") & (summary["n"] == 1) & (summary["variant"] == "base")]

    def ideal_throughput(ax, ns):
        for batch, x in zip(x01["batch"], x01["samples_per_s"]):
            ax.plot(ns, [n * x for n in ns], "k--", alpha=0.6, label="ideal: n x 01" + (f" [B={batch}]" if len(x01) > 1 else ""))

    target = f"{settings.target_acc:.2%}"
    plots = [("throughput.png", "Training throughput", "samples_per_s", "throughput (samples/s, all devices)",
              dict(ideal=ideal_throughput)),
             ("efficiency.png", "Scaling efficiency E(n) = X(n) / (n X(01))", "efficiency", "efficiency (%)",
              dict(scale=100, ideal=lambda ax, ns: ax.axhline(100, color="k", linestyle="--", label="ideal (100%)"),
                   empty="no baseline: 01 at n = 1 did not finish")),
             ("time_to_target.png", f"Time to {target} test accuracy (training time)", "time_to_target_s",
              "time to target (s)", dict(bars=True, empty="synthetic data: accuracy is meaningless" if settings.synthetic
                                         else f"no run reached {target} test accuracy")),
             ("accuracy.png", "Final test accuracy (10,000 images)", "test_accuracy", "test accuracy (%)",
              dict(bars=True, scale=100, empty="no run finished"))]
    for name, title, column, ylabel, options in plots:
        draw(summary, column, title, ylabel, os.path.join(out_dir, name), hardware, xlabel, **options)
    return [(name, title) for name, title, *_ in plots]
