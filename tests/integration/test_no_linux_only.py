"""No call that only Linux has, run as a user runs it: what Windows lacks (fcntl, resource, os.sched_getaffinity)
hidden from the repository's own code by the hook in tests/no_linux_only, torch keeping its own; the harness plans
a sweep under it, and the doctor trains every numbered script under it (tests/integration/test_doctor.py). The
other platforms' paths, in this process: tests/unit/test_platforms.py."""
import os
import re
import sys

from bench import machine
from helpers import ROOT, run, without_linux_only


PROBE = '''
import importlib, os, torch  # torch imports fcntl for itself
for attempt in ["import fcntl", "from resource import getrlimit", "importlib.import_module('resource')"]:
    try:
        exec(attempt)
        print("imported:", attempt)
    except ImportError:
        print("refused:", attempt)
print("sched_getaffinity:", hasattr(os, "sched_getaffinity"))
'''
# Every numbered script runs under this hook in the doctor's training runs (tests/integration/test_doctor.py).


def test_the_hook_refuses_what_windows_lacks_to_the_repositorys_code_only(tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "probe.py").write_text(PROBE)
    env, log = without_linux_only(tmp_path, root=tmp_path / "repo")
    said = run([sys.executable, str(tmp_path / "repo" / "probe.py")], env=env, timeout=120).stdout.splitlines()
    assert said == ["refused: import fcntl", "refused: from resource import getrlimit",
                    "refused: importlib.import_module('resource')", "sched_getaffinity: False"]
    assert len(log.read_text().splitlines()) == 1


def test_the_harness_plans_a_sweep_without_what_only_linux_has(tmp_path, monkeypatch):
    env, log = without_linux_only(tmp_path)
    result = run([sys.executable, "bench/run_all.py", "--dry-run"], env=env, timeout=120)
    assert log.read_text()
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # cores as macOS and Windows count them: all
    folder = re.escape(os.path.join(ROOT, "results", machine.machine_tag([])))
    assert re.search(rf"runs planned.*; results in {folder}(-\d+)?$", result.stdout.splitlines()[0]), result.stdout
