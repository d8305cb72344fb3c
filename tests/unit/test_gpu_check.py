"""bench/gpu_check.py, the one command for a lent GPU machine: every step bounded, whatever one does, and all of
it left in one log and one archive. Its steps are stand-ins here; `--cpu` runs the real ones on the CPU."""
import sys
import tarfile
import time

from bench import gpu_check
from helpers import busy_note, slack

PY = sys.executable


def test_every_step_is_bounded_and_reported_and_the_archive_holds_what_they_wrote(tmp_path, monkeypatch, capsys):
    def stand_ins(work, cpu):
        return [("passes", [PY, "-c", f"open({str(work)!r} + '/table.json', 'w').write('{{}}'); print('all well')"], 30),
                ("fails", [PY, "-c", "import sys; sys.exit('broken on purpose')"], 30),
                ("hangs", [PY, "-c", "import time; time.sleep(600)"], 3),
                ("absent", None, 30)]
    monkeypatch.setattr(gpu_check, "steps", stand_ins)
    started = time.monotonic()
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 1
    took = time.monotonic() - started
    assert took < 3 + slack(57), f"{took:.0f} s ({busy_note()})"  # the hanging step cost its bound, not ten minutes
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert "== passes: ok" in log and "all well" in log
    assert "== fails: FAILED (exit code 1)" in log and "broken on purpose" in log
    assert "== hangs: TIMEOUT after 3 s" in log and "== absent: skipped" in log
    assert log.rstrip().endswith("FAILED: fails, hangs")
    with tarfile.open(tmp_path / "out" / "gpu-check.tgz") as archive:
        names = archive.getnames()
    assert "gpu-check/table.json" in names and "gpu-check/passes.log" in names
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu-check.log", "gpu-check.tgz"]


def test_an_output_folder_that_cannot_be_written_is_refused_before_any_step(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("kept")
    assert gpu_check.main(["--out", str(blocker / "out")]) == 2
    assert capsys.readouterr().err.startswith("error: cannot write in --out") and blocker.read_text() == "kept"
