"""Files written atomically (a reader, or a Ctrl-C, never sees half of one), and reading JSON back."""
import argparse
import json
import os


def write_atomically(path, write):
    """write(temporary path), then one os.replace onto path."""
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def write_text(path, text):
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    write_atomically(path, write)


def write_json(path, obj):
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path, default=None):
    """The JSON at path, or default when it is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def json_path(path):
    """argparse type of the tools' --json: refuse an unwritable path before measuring, not after minutes of it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {path}: {folder} does not exist or is not writable")
    return path
