"""The doctor (`python bench/doctor.py`), run as a user runs it on this CPU-only machine: every check in one
table, every script trained without what only Linux has, a broken collective, GPUs torch cannot use, and bad
arguments (its checks in this process: tests/unit/test_doctor_checks.py)."""
import json
import os
import sys
import time

import pytest

from helpers import busy_note, run, slack, without_linux_only
from bench.family import MODES

MACHINE_CHECKS = ["devices", "GPU memory", "versions", "topology", "/dev/shm", "ports", "settings"]
# The modes that run at no n the doctor tries on the CPU (1 and 2): their rows say so (11: a 2 x 2 mesh).
AT_4 = [name for name, mode in MODES.items() if not (mode.runs_with(1, True) or mode.runs_with(2, True))]


def doctor_run(tmp_path, *args, env=None, timeout=900):
    """The doctor as a user starts it, its table also as JSON; (result, the JSON, seconds it took)."""
    path = tmp_path / "doctor.json"
    started = time.monotonic()
    result = run([sys.executable, "bench/doctor.py", *args, "--json", str(path)], timeout=timeout, env=env,
                 check=False)
    return result, json.loads(path.read_text()) if path.exists() else None, time.monotonic() - started


def rows_by_check(report):
    return {r["check"]: r for r in report["rows"]}


@pytest.fixture(scope="module")
def ready(tmp_path_factory):
    """The whole doctor once: every check, the collective at n = 2 (gloo), a training run of each mode, all of it
    unable to use what only Linux has, as on macOS and Windows; (result, JSON, seconds, each process's program)."""
    tmp = tmp_path_factory.mktemp("ready")
    env, log = without_linux_only(tmp)
    return *doctor_run(tmp, env=env), [line.split(" ", 1)[1] for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """The doctor where gloo is told to use a network interface that does not exist, without the training runs."""
    return doctor_run(tmp_path_factory.mktemp("broken"), "--quick", env={"GLOO_SOCKET_IFNAME": "nosuchif"},
                      timeout=240)


def test_the_doctor_finds_this_cpu_machine_ready_with_every_check_in_one_table(ready):
    result, report, seconds, _ = ready
    # Its collective and runs have bounds (60 s, 120 s) that a busy machine's start-up of torch can pass.
    assert result.returncode == 0, f"{result.stdout}{result.stderr}({busy_note()})"
    assert "Traceback" not in result.stderr, result.stderr
    rows = rows_by_check(report)
    trains = [f"train {mode.script[:2]} {name}" for name, mode in MODES.items()]
    assert list(rows) == MACHINE_CHECKS + ["all-reduce n=2"] + trains
    assert all(r["status"] in ("ok", "skip") for r in report["rows"]), (report["rows"], busy_note())
    assert rows["devices"]["status"] == rows["versions"]["status"] == rows["all-reduce n=2"]["status"] == "ok"
    collective = rows["all-reduce n=2"]["detail"]
    assert "GB/s" in collective and "compare: gloo on loopback" in collective
    for name, mode in MODES.items():  # each mode trained at the largest n it runs at on the CPU: 2, 01 and 02 at 1
        row = rows[f"train {mode.script[:2]} {name}"]
        if name in AT_4:
            assert row["status"] == "skip" and row["detail"].startswith(f"{mode.script}: "), row  # not run
            continue
        assert row["status"] == "ok" and row["detail"].startswith(f"n={2 if mode.runs_with(2, True) else 1}:"), row
    table = result.stdout.splitlines()
    for r in report["rows"]:  # the same table on stdout, one line per check
        assert any(line.startswith(r["check"]) and f" {r['status']} " in line for line in table), r
    assert table[-1].startswith("READY") and report["ready"] is True
    print(f"the doctor took {seconds:.0f} s")


def test_every_script_the_doctor_trains_runs_without_what_only_linux_has(ready):
    """The doctor trains with the sweep's commands: each numbered script under its launcher, on MNIST files (where
    a download lock would be), the hook in every process, the launchers' and the workers' alike."""
    _, report, _, programs = ready
    rows = rows_by_check(report)
    for mode in MODES.values():
        if mode.name in AT_4:
            continue
        assert rows[f"train {mode.script[:2]} {mode.name}"]["status"] == "ok" and mode.script in programs, mode
    assert programs.count("03_ddp_launch.py") == 2 and "-c" in programs, programs  # torchrun's workers, spawn's


def test_a_broken_collective_fails_fast_naming_the_collective_and_the_fix(broken):
    result, report, seconds = broken
    assert result.returncode == 1, result.stdout + result.stderr
    rows = rows_by_check(report)
    collective = rows["all-reduce n=2"]
    assert collective["status"] == "FAIL"
    # gloo failed by itself, not by the doctor's 60-s bound (which a busy machine's start-up of torch can pass)
    assert "exit code" in collective["detail"], f"{collective} ({busy_note()})"
    assert "Unable to find address for: nosuchif" in collective["detail"]
    assert "GLOO_SOCKET_IFNAME" in collective["todo"]
    assert rows["settings"]["status"] == "FAIL" and "GLOO_SOCKET_IFNAME=nosuchif" in rows["settings"]["detail"]
    assert "lo" in rows["settings"]["todo"]  # the interfaces this machine has
    assert result.stdout.splitlines()[-1].startswith("NOT READY") and report["ready"] is False
    # The versions child, then gloo's own error: no wait for a timeout (the "exit code" above says so too).
    assert seconds < slack(180), f"{seconds:.0f} s ({busy_note()})"
    assert "Traceback" not in result.stdout




def test_gpus_that_torch_cannot_use_fail_the_devices_check_and_skip_the_collective(tmp_path, two_gpus):
    """This machine's torch has no GPU: with nvidia-smi listing two, the doctor says so and what to install,
    and still reports their memory and topology."""
    result, report, _ = doctor_run(tmp_path, "--quick", env={**two_gpus, "CUDA_VISIBLE_DEVICES": "0,1"}, timeout=240)
    assert result.returncode == 1, result.stdout + result.stderr
    rows = rows_by_check(report)
    assert rows["devices"]["status"] == "FAIL" and "cannot use CUDA" in rows["devices"]["detail"]
    assert "install a torch built for CUDA" in rows["devices"]["todo"]
    assert rows["GPU memory"]["status"] == "warn" and "pid 4242" in rows["GPU memory"]["detail"]
    assert rows["topology"]["detail"].startswith("NV18 x1")
    assert rows["all-reduce"]["status"] == "skip"






@pytest.mark.parametrize("args, says", [(["--cpu", "0"], "at least 1"), (["--gpus", "0"], "does not exist"),
                                        (["--json", "/no/such/folder/d.json"], "cannot write --json"),
                                        (["--json", "."], "cannot write --json"),
                                        (["--bogus"], "unrecognized")])
def test_bad_arguments_are_one_line_and_exit_2(args, says):
    result = run([sys.executable, "bench/doctor.py", *args], timeout=120, check=False)
    assert result.returncode == 2 and says in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""
    assert not os.path.exists("/no/such/folder")
