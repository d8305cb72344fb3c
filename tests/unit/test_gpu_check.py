"""bench/gpu_check.py, the one command for a lent GPU machine: every step bounded, whatever one does, and all of
it left in one log and one archive. Its steps are stand-ins here; `--cpu` runs the real ones on the CPU."""
import re
import sys
import tarfile
import time

from bench import gpu_check
from bench.processes import KILL_GRACE_S
from helpers import ROOT, busy_note, slack

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
    assert log.rstrip().endswith("FAILED: fails, hangs; SKIPPED, not a pass: absent")
    with tarfile.open(tmp_path / "out" / "gpu-check.tgz") as archive:
        names = archive.getnames()
    assert "gpu-check/table.json" in names and "gpu-check/passes.log" in names
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu-check.log", "gpu-check.tgz"]


def test_an_output_folder_that_cannot_be_written_is_refused_before_any_step(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("kept")
    assert gpu_check.main(["--out", str(blocker / "out")]) == 2
    assert capsys.readouterr().err.startswith("error: cannot write in --out") and blocker.read_text() == "kept"


# ---- a cut step, a missing pytest, tests that all skip; the steps' selection and sizes

def test_a_step_cut_at_its_bound_still_leaves_its_log_and_what_it_writes_on_sigterm_in_the_archive(tmp_path,
                                                                                                   monkeypatch):
    # as the sweep does (report.md and plots of the finished runs) and the doctor (its table and --json)
    writes_on_sigterm = ("import signal, sys, time\n"
                         "def cut(*_):\n"
                         "    open(sys.argv[1] + '/report.md', 'w').write('the runs that finished')\n"
                         "    sys.exit(130)\n"
                         "signal.signal(signal.SIGTERM, cut)\n"
                         "print('started', flush=True)\n"
                         "time.sleep(600)\n")
    monkeypatch.setattr(gpu_check, "steps", lambda work, cpu: [("sweep", [PY, "-c", writes_on_sigterm, work], 3)])
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 1
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert "== sweep: TIMEOUT after 3 s" in log and "started" in log and log.rstrip().endswith("FAILED: sweep")
    with tarfile.open(tmp_path / "out" / "gpu-check.tgz") as archive:
        assert {"gpu-check/sweep.log", "gpu-check/report.md"} <= set(archive.getnames())
        assert archive.extractfile("gpu-check/report.md").read() == b"the runs that finished"


def test_a_cut_step_has_longer_to_end_than_a_run_has(tmp_path, monkeypatch):
    """A cut step's sweep or doctor ends its own runs first (each KILL_GRACE_S), then writes its report: the step
    gets CUT_GRACE_S between its SIGTERM and SIGKILL, not a run's grace."""
    graces = []

    def spy(cmds, logs, timeout, grace=KILL_GRACE_S):
        graces.append(grace)
        open(logs[0], "w").close()
        return 0, False
    monkeypatch.setattr(gpu_check, "run_processes", spy)
    gpu_check.run_step("sweep", [PY, "-c", "pass"], 3, str(tmp_path))
    assert graces == [gpu_check.CUT_GRACE_S] and gpu_check.CUT_GRACE_S > 2 * KILL_GRACE_S


def test_a_hung_command_inside_a_step_is_given_up_on_before_the_step_is_cut(tmp_path, monkeypatch):
    """A hung nvidia-smi or collect_env inside the doctor: machine.output_of waits at most the step's bound over
    MARGIN, so the step goes on and writes its table instead of being cut with nothing."""
    hangs = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from bench import machine; " \
            "print('gave up' if machine.output_of([sys.executable, '-c', 'import time; time.sleep(60)']) is None " \
            "else 'answered')"
    monkeypatch.setattr(gpu_check, "steps", lambda work, cpu: [("doctor", [PY, "-c", hangs], 4)])  # gives up at 2 s
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 0
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert "== doctor: ok" in log and "gave up" in log, log


def test_without_pytest_the_test_steps_are_skipped_and_the_check_is_not_a_pass(tmp_path, monkeypatch):
    find_spec = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec",
                        lambda name: None if name == "pytest" else find_spec(name))
    real = {name: argv for name, argv, _ in gpu_check.steps(str(tmp_path), cpu=False)}
    assert real["gpu tests"] is None and real["two ranks"] is None
    assert all(real[name] for name in ("warm up", "doctor", "sweep"))
    monkeypatch.setattr(gpu_check, "steps", lambda work, cpu: [("passes", [PY, "-c", "pass"], 30),
                                                               ("gpu tests", None, 30)])
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 1
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert "== gpu tests: skipped" in log and "pip install pytest" in log
    assert log.rstrip().endswith("== SKIPPED, not a pass: gpu tests") and "every step passed" not in log


def test_a_test_step_whose_every_test_skipped_is_skipped_not_ok(tmp_path, monkeypatch):
    """pytest exits 0 when every test skips (no CUDA): its report, not its exit status, says what ran."""
    def pytest_like(tests, skipped, failures=0):
        xml = (f'<testsuites><testsuite name="pytest" tests="{tests}" failures="{failures}" errors="0" '
               f'skipped="{skipped}"/></testsuites>')
        return [PY, "-c", f"import sys; open(sys.argv[2], 'w').write({xml!r})", "--junitxml",
                str(tmp_path / f"{tests}-{skipped}.xml")]
    monkeypatch.setattr(gpu_check, "steps", lambda work, cpu: [("all skip", pytest_like(5, 5), 30),
                                                               ("some ran", pytest_like(5, 1), 30)])
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 1
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert "== all skip: skipped (every test skipped): 0 passed, 0 failed, 5 skipped" in log
    assert "== some ran: ok: 4 passed, 0 failed, 1 skipped" in log
    assert log.rstrip().endswith("== SKIPPED, not a pass: all skip")


def test_every_step_is_bounded_with_a_third_to_spare_over_its_work_at_the_slowest_start_up():
    for cpu in (False, True):
        for name, (work, bound) in gpu_check.projected(cpu).items():
            assert work <= bound * 2 / 3, (name, work, bound)
        sweep, bound = {name: (argv, limit) for name, argv, limit in gpu_check.steps("/w", cpu)}["sweep"]
        assert int(sweep[sweep.index("--timeout") + 1]) < bound, (sweep, bound)  # the sweep's runs, within the step


def with_lightning(monkeypatch):
    """Lightning installed, whether it is here or not: its runs make the two ranks step the longest it gets."""
    find_spec = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec",
                        lambda name: object() if name == "lightning" else find_spec(name))


def test_on_an_h200_the_whole_check_ends_within_one_device_call_whatever_hangs(monkeypatch):
    """Every step cut at its bound, each with its grace: still within the one call, with SPARE_S to spare."""
    with_lightning(monkeypatch)
    bounds = [limit for _, _, limit in gpu_check.steps("/w", cpu=False)]
    worst = sum(bounds) + len(bounds) * gpu_check.CUT_GRACE_S
    assert worst + gpu_check.SPARE_S <= gpu_check.CALL_S == 540, worst


def test_the_warm_up_comes_first_and_imports_torch_and_torchvision_and_starts_cuda():
    """A cold machine's first import of torch is slow: the doctor, bounded, must not be the one to pay for it."""
    for cpu in (False, True):
        planned = gpu_check.steps("/w", cpu)
        assert [name for name, _, _ in planned] == ["warm up", "doctor", "gpu tests", "two ranks", "sweep"]
        warm_up = planned[0][1]
        assert "import torch, torchvision" in warm_up[2] and "torch.cuda.init()" in warm_up[2]
        assert warm_up[3] == ("cpu" if cpu else "cuda")  # the CPU check starts no CUDA


def test_the_docstring_and_docs_benchmark_md_give_each_steps_projected_work_and_bound(monkeypatch):
    """On one H200 with Lightning: the module's own docstring, and the GPU check's table in docs/benchmark.md."""
    with_lightning(monkeypatch)
    table = (ROOT / "docs" / "benchmark.md").read_text()
    for name, (work, bound) in gpu_check.projected(cpu=False).items():
        line = f"{round(work)} / {bound} s"
        assert re.search(rf"^    {name} .* {line}$", gpu_check.__doc__, re.M), (name, line)
        assert re.search(rf"^\| {name} \|.*\| {round(work)} s \| {bound} s \|$", table, re.M), (name, line)
    total = sum(bound for _, bound in gpu_check.projected(cpu=False).values())
    worst = total + len(gpu_check.STEPS) * gpu_check.CUT_GRACE_S
    for text in (gpu_check.__doc__, table):
        assert f"up to {total} s" in text and f"{worst} s whatever hangs" in text
