"""Atomic file writes: a reader (or a Ctrl-C) never sees half a file."""
import json
import os


def _tmp(path):
    return f"{path}.tmp{os.getpid()}"


def read_json(path, default=None):
    """The JSON at path, or default when it is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def write_text(path, text):
    tmp = _tmp(path)
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path, obj):
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def write_csv(path, frame):
    """A pandas DataFrame as CSV, written in one os.replace."""
    tmp = _tmp(path)
    frame.to_csv(tmp, index=False)
    os.replace(tmp, path)


def save_figure(fig, path):
    tmp = _tmp(path)
    fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    os.replace(tmp, path)
