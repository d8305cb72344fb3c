"""Every tested cell of the guarantee table (tests/guarantees.py) names a test that pytest collects: drop a mode
from a test's parametrization, or rename the test, and the table fails here (its cells:
unit/test_guarantee_table.py)."""
import subprocess
import sys

import guarantees
from helpers import ROOT


def test_every_tested_cell_names_a_test_that_pytest_collects():
    cells = guarantees.cells()
    named = {what for kind, what in cells.values() if kind == "tested"}
    files = sorted({what.split("::")[0] for what in named})
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    collected = set(result.stdout.splitlines())
    missing = sorted(what for what in named if what not in collected)
    assert not missing, f"the guarantee table names tests pytest does not collect: {missing}\n{result.stdout[-2000:]}"
