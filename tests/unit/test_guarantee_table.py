"""The guarantee table (tests/guarantees.py): a cell for every guarantee and every mode of the family, and
tests/README.md showing it as it is (the tests it names exist: tests/integration/test_guarantee_tests_exist.py)."""
import dataclasses

import guarantees
from helpers import MODES, ROOT

KINDS = {"tested", "n/a", "refused"}


def test_every_guarantee_has_a_cell_for_every_mode_of_the_family():
    table = guarantees.cells()
    assert len(table) == len(guarantees.GUARANTEES) * len(MODES)
    for (words, name), (kind, what) in table.items():
        assert kind in KINDS and what, (words, name)
        if kind == "tested":
            assert what.startswith("tests/") and "::test_" in what, (words, name, what)


def test_a_new_row_of_the_family_gets_a_cell_in_every_guarantee_at_once(monkeypatch):
    """A script added as 13, 12's twin: no guarantee needs an edit to cover it, and its tested cells name it."""
    twin = dataclasses.replace(MODES["fsdp_big"], name="fsdp_big_twin", script="13_fsdp_big_twin.py")
    monkeypatch.setitem(guarantees.MODES, twin.name, twin)
    table = guarantees.cells()
    cells = [table[words, twin.name] for words, _ in guarantees.GUARANTEES]
    assert [kind for kind, _ in cells] == [kind for kind, _ in (table[w, "fsdp_big"] for w, _ in guarantees.GUARANTEES)]
    assert any("13_fsdp_big_twin.py" in what for kind, what in cells if kind == "tested")


def test_the_tests_readme_shows_the_table_as_it_is():
    readme = (ROOT / "tests" / "README.md").read_text()
    shown = readme.split("<!-- guarantees -->\n")[1].split("<!-- end guarantees -->")[0]
    assert shown == guarantees.markdown(), "tests/README.md: paste the output of python tests/guarantees.py"
