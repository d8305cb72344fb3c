"""Files written atomically (a reader, or a Ctrl-C, never sees half of one), and JSON read back."""
import argparse
import contextlib
import json
import os
import pathlib
import tempfile


def write_atomically(path, write):
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def write_text(path, text):
    write_atomically(path, lambda tmp: pathlib.Path(tmp).write_text(text))


def write_json(path, obj):
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path, default=None):
    with contextlib.suppress(OSError, ValueError):
        return json.loads(pathlib.Path(path).read_text())
    return default


def json_path(path):
    """argparse type of the tools' --json, tried by writing beside it before measuring, not after minutes of it."""
    try:
        tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(path))).close()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {path}: {e.strerror}")
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"cannot write {path}: it is a folder")
    return path
