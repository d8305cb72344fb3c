"""Files written atomically (a reader, or a Ctrl-C, never sees half of one), and JSON read back."""
import contextlib
import json
import os
import pathlib


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

