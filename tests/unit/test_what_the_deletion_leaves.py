"""A copier deletes the measurement (the fenced block and the lines marked '# measure', as the README says) and
keeps a script with nothing left over: no import, constant, flag or field of the world that only the measurement
used. (That the rest still trains: tests/integration/test_trainers.py.)"""
import ast
import re

import pytest

from helpers import ROOT, SCRIPTS, without_the_measurement


def flags_of(call):
    """The --flags an add_argument call declares ([] for any other call)."""
    if getattr(call.func, "attr", None) != "add_argument":
        return []
    return [a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]


def unused(source):
    """What source imports, assigns at module level, takes as a flag or puts into a SimpleNamespace, and never
    reads."""
    tree = ast.parse(source)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)}
    found = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found += [f"import {name}" for name in ((a.asname or a.name).split(".")[0] for a in node.names)
                      if name not in names]
        elif isinstance(node, ast.Assign):
            found += [f"constant {t.id}" for t in node.targets if isinstance(t, ast.Name) and t.id not in names]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        flags = flags_of(node)  # p.add_argument("--flag", ...): args.flag read
        dest = next((k.value.value for k in node.keywords if k.arg == "dest"), None)
        if flags and (dest or flags[0][2:].replace("-", "_")) not in read:
            found.append(f"flag {flags[0]}")
        if getattr(node.func, "id", None) == "SimpleNamespace":
            found += [f"field {k.arg}" for k in node.keywords if k.arg not in read]
    return found


def flags(source):
    """The flags source's parsers take."""
    return {flag for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) for flag in flags_of(n)}


def dead_mentions(script, left):
    """The flags the deletion took out of script that left still names (a usage line, an error message)."""
    gone = flags((ROOT / script).read_text()) - flags(left)
    assert gone, "the deletion took no flag: nothing to look for"
    return sorted(flag for flag in gone if re.search(rf"{flag}\b", left))


@pytest.mark.parametrize("script", SCRIPTS)
def test_deleting_the_measurement_leaves_nothing_unused(script):
    assert unused(without_the_measurement(script)) == []


def test_the_check_finds_an_unused_import_flag_and_field():
    copy = without_the_measurement("03_ddp_launch.py")
    planted = copy.replace("import os\n", "import os\nimport json\n", 1)
    planted = planted.replace('    p.add_argument("--cpu"', '    p.add_argument("--nodes", type=int)\n    p.add_argument("--cpu"', 1)
    planted = planted.replace("is_main=rank == 0)", "is_main=rank == 0, backend=backend)", 1)
    assert unused(planted) == ["import json", "flag --nodes", "field backend"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_deleting_the_measurement_leaves_no_mention_of_a_flag_it_took(script):
    assert dead_mentions(script, without_the_measurement(script)) == []


def test_the_check_finds_a_message_naming_a_deleted_flag():
    planted = without_the_measurement("03_ddp_launch.py").replace("/MNIST/raw/", "/MNIST/raw/, or try --synthetic")
    assert dead_mentions("03_ddp_launch.py", planted) == ["--synthetic"]
