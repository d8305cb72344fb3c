"""Files written atomically (a reader, or a Ctrl-C, never sees half of one), and JSON read back."""
import argparse
import contextlib
import json
import os
import pathlib


def write_atomically(path, write):
    """write(a temporary path), then one os.replace onto path."""
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def write_text(path, text):
    write_atomically(path, lambda tmp: pathlib.Path(tmp).write_text(text))


def write_json(path, obj):
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path, default=None):
    """The JSON at path, or default when it is missing or unreadable."""
    with contextlib.suppress(OSError, ValueError):
        return json.loads(pathlib.Path(path).read_text())
    return default


def json_path(path):
    """argparse type of the tools' --json: refuse an unwritable path before measuring, not after minutes of it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {path}: {folder} does not exist or is not writable")
    return path
