"""The GPU check's steps, started as they run on a bare machine: the two test steps collected by pytest (between
them every GPU test once, every numbered script among them, without pandas or matplotlib), the warm-up, and the
four checks of the two-ranks step, as gloo runs them on the CPU (the rest of the GPU check, in this process:
tests/unit/test_gpu_check.py)."""
import json
import re
import sys
import warnings

import test_gpu as gpu_tests
from bench import anatomy, gpu_check
from helpers import EXIT_ABORT, SCRIPTS, run
from test_step_anatomy import ddp, fsdp

PY = sys.executable


def collected(argv, env):
    """The tests a step's pytest command selects, collected only (no junit report)."""
    argv = argv[:argv.index("--junitxml")] + ["--collect-only"] + argv[argv.index("--junitxml") + 2:]
    result = run(argv, env=env, timeout=300)
    return {line for line in result.stdout.splitlines() if line.startswith("tests/integration/test_gpu.py::")}


def test_the_two_test_steps_select_every_gpu_test_once_and_every_script_without_pandas_or_matplotlib(tmp_path):
    for name in ("pandas", "matplotlib"):  # a bare machine's Python: neither can be imported
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('no {name} on this machine')")
    env = {"PYTHONPATH": str(tmp_path)}
    argv = {name: argv for name, argv, _ in gpu_check.steps(str(tmp_path), False) if argv and "pytest" in argv}
    tests, two_ranks = collected(argv["gpu tests"], env), collected(argv["two ranks"], env)
    every = collected([PY, "-m", "pytest", "-q", "tests/integration/test_gpu.py", "--junitxml", "x.xml"], {})
    assert tests and two_ranks and not tests & two_ranks and tests | two_ranks == every, (tests, two_ranks, every)
    assert all("two_ranks" in t for t in two_ranks), two_ranks
    # Each numbered script of bench/family.py trains in one of the two steps: a new one joins by its row alone.
    trained = {re.search(r"\[(.*)\]", t).group(1) for t in tests | two_ranks if "[" in t}
    assert trained == set(SCRIPTS), set(SCRIPTS) ^ trained
    assert "09_tensor_parallel.py" in {t[t.index("[") + 1:-1] for t in two_ranks if "[" in t}  # on CUDA, 2 ranks


def test_the_warm_up_imports_torch_and_starts_cuda_or_says_why_it_cannot(tmp_path):
    steps = {cpu: dict((name, argv) for name, argv, _ in gpu_check.steps(str(tmp_path), cpu)) for cpu in (False, True)}
    on_the_cpu = run(steps[True]["warm up"], timeout=120)
    assert re.match(r"torch \S+, torchvision \S+, CUDA available: False; \d+ s", on_the_cpu.stdout), on_the_cpu.stdout
    cuda = run(steps[False]["warm up"], timeout=120, check=False)  # here, without a GPU: the step fails, saying why
    assert cuda.returncode != 0 and ("NVIDIA driver" in cuda.stderr or "CUDA" in cuda.stderr), cuda.stderr



def test_the_two_ranks_steps_four_checks_run_on_the_cpu_as_on_the_gpu(tmp_path, monkeypatch):
    """The anatomy of 03 and 08, 12 killed and resumed, the flight recorder: started as the GPU check starts them,
    all at once, here as two gloo ranks. On gloo the bytes are gloo's closed forms: 08's gradient all-reduced."""
    monkeypatch.setattr(gpu_tests, "WORK", str(tmp_path / "archive"))
    checks = gpu_tests.four_checks(tmp_path)
    checks.pop("nccl2")  # NCCL2 is NCCL's alone: on the CPU it would be 03 again
    killed, recorder = checks["killed"][0], checks["flight recorder"][0]
    runs = gpu_tests.train_at_once([], tmp_path, 240, checks)
    # torch's abort at a finished worker's exit (helpers.run) makes one agent restart while the other waits at its
    # exit: the killed check runs once more, alone, in a new folder.
    if runs["killed"].failure and EXIT_ABORT in runs["killed"].output:
        warnings.warn(f"the killed check: torch aborted a worker at exit ({EXIT_ABORT}); run again")
        killed = gpu_tests.kept(tmp_path, "killed-again")
        runs.update(gpu_tests.train_at_once([], tmp_path, 240, {"killed": (killed, gpu_tests.killed_ranks(killed))}))
    assert all(r.failure is None for r in runs.values()), {k: r.failure for k, r in runs.items()}
    for script, form in zip(gpu_tests.ANATOMY, [ddp(), fsdp(2)]):
        ranks, _ = anatomy.analyse(str(runs[script].out), 2)
        kinds = [gpu_tests.nccl_kinds(step["collectives"]) for rank in ranks for step in rank["steps"]]
        assert all({k: {f: got[k][f] for f in v} for k, v in form.items()} == form for got in kinds), kinds
    assert "resuming from" in runs["killed"].output and list((killed / "hook").glob("killed-*.json"))
    assert any(json.loads(p.read_text())["restart"] == "1" for p in (killed / "hook").glob("[0-9]*.json"))
    assert "missing ranks: {1}" in (recorder / "analysis.txt").read_text()
    assert recorder.parent == tmp_path / "archive", "what the checks measure goes into the GPU check's archive"
