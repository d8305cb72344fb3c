"""The GPU check's test steps, collected by pytest as they run on a bare machine: between them every GPU test once,
without pandas or matplotlib (the rest of the GPU check, in this process: tests/unit/test_gpu_check.py)."""
import sys

from bench import gpu_check
from helpers import run

PY = sys.executable


def collected(argv, env):
    """The tests a step's pytest command selects, collected only (no junit report)."""
    argv = argv[:argv.index("--junitxml")] + ["--collect-only"] + argv[argv.index("--junitxml") + 2:]
    result = run(argv, env=env, timeout=300)
    return {line for line in result.stdout.splitlines() if line.startswith("tests/integration/test_gpu.py::")}


def test_the_two_test_steps_select_every_gpu_test_once_without_pandas_or_matplotlib(tmp_path):
    for name in ("pandas", "matplotlib"):  # a bare machine's Python: neither can be imported
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('no {name} on this machine')")
    env = {"PYTHONPATH": str(tmp_path)}
    argv = {name: argv for name, argv, _ in gpu_check.steps(str(tmp_path), False) if argv and "pytest" in argv}
    tests, two_hosts = collected(argv["gpu tests"], env), collected(argv["two hosts"], env)
    every = collected([PY, "-m", "pytest", "-q", "tests/integration/test_gpu.py", "--junitxml", "x.xml"], {})
    assert tests and two_hosts and not tests & two_hosts and tests | two_hosts == every, (tests, two_hosts, every)
    assert all("two_nodes" in t or "own_gpu" in t for t in two_hosts), two_hosts
