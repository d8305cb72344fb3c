"""The four plots of a sweep, each readable on its own: hardware in the title, units on the axes, a legend."""
import os

import matplotlib

matplotlib.use("Agg")  # files only: works on machines without a display
import matplotlib.pyplot as plt  # noqa: E402

from files import save_figure  # noqa: E402
from sweep import MODES, SCRIPTS  # noqa: E402

LABELS = {m: f"{SCRIPTS[m][:2]} {m}" for m in MODES}


def _series(summary):
    """(label, rows of one mode and variant sorted by n) for every line of a plot."""
    many = summary["variant"].nunique() > 1
    for (variant, mode), rows in summary.groupby(["variant", "mode"], sort=False):
        yield LABELS.get(mode, mode) + (f" [{variant}]" if many else ""), rows.sort_values("n")


def _figure(title, hardware, xlabel, ylabel):
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.set_title(f"{title}\n{hardware}", fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _legend(ax):
    # Outside the axes, so that it never hides a bar or a point.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0, fontsize=9)


def _note(ax, text):
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=10, color="0.4", wrap=True)


def _integer_ticks(ax, summary):
    ax.set_xticks(sorted(summary["n"].unique()))


def throughput(summary, hardware, xlabel, path):
    fig, ax = _figure("Training throughput", hardware, xlabel, "throughput (samples/s, all devices)")
    for label, rows in _series(summary):
        ax.plot(rows["n"], rows["samples_per_s"], marker="o", label=label)
    base = summary[(summary["mode"] == "single") & (summary["n"] == 1)]
    if len(base):
        ns = sorted(summary["n"].unique())
        ax.plot(ns, [n * base["samples_per_s"].iloc[0] for n in ns], "k--", label="ideal: n x 01")
    _integer_ticks(ax, summary)
    ax.set_ylim(bottom=0)
    _legend(ax)
    save_figure(fig, path)
    plt.close(fig)


def efficiency(summary, hardware, xlabel, path):
    fig, ax = _figure("Scaling efficiency E(n) = X(n) / (n * X(01))", hardware, xlabel, "efficiency (%)")
    drawn = False
    for label, rows in _series(summary):
        rows = rows.dropna(subset=["efficiency"])
        if len(rows):
            ax.plot(rows["n"], 100 * rows["efficiency"], marker="o", label=label)
            drawn = True
    ax.axhline(100, color="k", linestyle="--", label="ideal (100%)")
    if not drawn:
        _note(ax, "no baseline: 01 at n = 1 did not run or did not finish")
    _integer_ticks(ax, summary)
    ax.set_ylim(bottom=0)
    _legend(ax)
    save_figure(fig, path)
    plt.close(fig)


def _bars(summary, column, scale, hardware, title, xlabel, ylabel, path, empty_note):
    """Grouped bars: one group per n, one bar per mode (accuracy and time to target are not lines)."""
    fig, ax = _figure(title, hardware, xlabel, ylabel)
    series = list(_series(summary))
    ns = sorted(summary["n"].unique())
    width = 0.8 / max(len(series), 1)
    drawn = False
    for i, (label, rows) in enumerate(series):
        rows = rows.dropna(subset=[column])
        if len(rows):
            xs = [ns.index(n) + (i - (len(series) - 1) / 2) * width for n in rows["n"]]
            ax.bar(xs, scale * rows[column], width=width, label=label)
            drawn = True
    ax.set_xticks(range(len(ns)), [str(n) for n in ns])
    if drawn:
        _legend(ax)
    else:
        _note(ax, empty_note)
    save_figure(fig, path)
    plt.close(fig)


def write_all(out_dir, summary, hardware, settings):
    xlabel = "n (processes on the CPU)" if settings.cpu else "n (GPUs)"
    if settings.synthetic:
        hardware += " - synthetic data"
    throughput(summary, hardware, xlabel, os.path.join(out_dir, "throughput.png"))
    efficiency(summary, hardware, xlabel, os.path.join(out_dir, "efficiency.png"))
    why = ("synthetic data: accuracy is meaningless" if settings.synthetic
           else f"no run reached {settings.target_acc:.2%} test accuracy")
    _bars(summary, "time_to_target_s", 1, hardware, f"Time to {settings.target_acc:.2%} test accuracy (training time)",
          xlabel, "time to target (s)", os.path.join(out_dir, "time_to_target.png"), why)
    _bars(summary, "test_accuracy", 100, hardware, "Final test accuracy (10,000 images)", xlabel, "test accuracy (%)",
          os.path.join(out_dir, "accuracy.png"), "no run finished")
