"""The doctor (`python bench/doctor.py`), run as a user runs it on this CPU-only machine, and the checks it shares
with the harness (bench/checks.py): busy GPUs from nvidia-smi, interfaces, and the cause and fix of a failure."""
import importlib.util
import json
import os
import socket
import sys
import time

import pytest

from conftest import fake_command, run, without_linux_only
from bench import checks, doctor, measurements, runs_table
from bench.processes import KILL_GRACE_S
from bench.scripts import MODES

MACHINE_CHECKS = ["devices", "GPU memory", "versions", "topology", "/dev/shm", "ports", "settings"]


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


@pytest.mark.slow
def test_the_doctor_finds_this_cpu_machine_ready_with_every_check_in_one_table(ready):
    result, report, seconds, _ = ready
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    rows = rows_by_check(report)
    trains = [f"train {mode.script[:2]} {name}" for name, mode in MODES.items()]
    assert list(rows) == MACHINE_CHECKS + ["all-reduce n=2"] + trains
    assert all(r["status"] in ("ok", "skip") for r in report["rows"]), report["rows"]
    assert rows["devices"]["status"] == rows["versions"]["status"] == rows["all-reduce n=2"]["status"] == "ok"
    collective = rows["all-reduce n=2"]["detail"]
    assert "GB/s" in collective and "compare: gloo on loopback" in collective
    for name, mode in MODES.items():  # each mode trained at the largest n it runs at on the CPU: 2, 01 and 02 at 1
        row = rows[f"train {mode.script[:2]} {name}"]
        assert row["status"] == "ok" and row["detail"].startswith(f"n={2 if mode.runs_with(2, True) else 1}:"), row
    table = result.stdout.splitlines()
    for r in report["rows"]:  # the same table on stdout, one line per check
        assert any(line.startswith(r["check"]) and f" {r['status']} " in line for line in table), r
    assert table[-1].startswith("READY") and report["ready"] is True
    print(f"the doctor took {seconds:.0f} s")


@pytest.mark.slow
def test_every_script_the_doctor_trains_runs_without_what_only_linux_has(ready):
    """The doctor trains with the sweep's commands: each numbered script under its launcher, on MNIST files (where
    a download lock would be), the hook in every process, the launchers' and the workers' alike."""
    _, report, _, programs = ready
    rows = rows_by_check(report)
    for mode in MODES.values():
        assert rows[f"train {mode.script[:2]} {mode.name}"]["status"] == "ok" and mode.script in programs, mode
    assert programs.count("03_ddp_launch.py") == 2 and "-c" in programs, programs  # torchrun's workers, spawn's


def test_a_broken_collective_fails_fast_naming_the_collective_and_the_fix(broken):
    result, report, seconds = broken
    assert result.returncode == 1, result.stdout + result.stderr
    rows = rows_by_check(report)
    collective = rows["all-reduce n=2"]
    assert collective["status"] == "FAIL"
    assert "exit code" in collective["detail"], collective  # gloo failed by itself, not by the doctor's time bound
    assert "Unable to find address for: nosuchif" in collective["detail"]
    assert "GLOO_SOCKET_IFNAME" in collective["todo"]
    assert rows["settings"]["status"] == "FAIL" and "GLOO_SOCKET_IFNAME=nosuchif" in rows["settings"]["detail"]
    assert "lo" in rows["settings"]["todo"]  # the interfaces this machine has
    assert result.stdout.splitlines()[-1].startswith("NOT READY") and report["ready"] is False
    assert seconds < 180  # the versions child, then gloo's own error: no wait for a timeout
    assert "Traceback" not in result.stdout


def test_a_collective_that_does_not_answer_in_time_fails_with_the_hang_advice_at_the_bound(monkeypatch, tmp_path):
    """A hung all-reduce, stood in for by the bound cut to 1 s (the tool's start-up alone takes longer)."""
    monkeypatch.setattr(measurements, "COLLECTIVE_TIMEOUT_S", 1)
    (tmp_path / "logs").mkdir()
    started = time.monotonic()
    rows, failed = doctor.collective_rows(doctor.doctor_settings([], doctor.parse_args([]), str(tmp_path)),
                                          str(tmp_path))
    assert failed == {2} and rows[0]["status"] == "FAIL" and "no answer within 1 s" in rows[0]["detail"]
    assert rows[0]["todo"] == checks.advice("Timed out") and "NCCL_P2P_DISABLE=1" in rows[0]["todo"]
    assert time.monotonic() - started < 1 + 2 * KILL_GRACE_S + 5  # the bound, then SIGTERM and SIGKILL


# ---- busy GPUs, through a stand-in nvidia-smi

NVIDIA_SMI = {
    "--query-gpu=index,uuid,name --format=csv,noheader": "0, GPU-aaaa, NVIDIA H200\n1, GPU-bbbb, NVIDIA H200",
    "--query-gpu=index,uuid,memory.used --format=csv,noheader,nounits": "0, GPU-aaaa, 40321\n1, GPU-bbbb, 1",
    "--query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits":
        "GPU-aaaa, 4242, /usr/bin/python3, 40310",
    "topo -m": "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV18\t0-15\nGPU1\tNV18\t X \t0-15\n\nLegend:\n  X = Self",
}


@pytest.fixture
def two_gpus(tmp_path, monkeypatch):
    if os.name == "nt":
        pytest.skip("the stand-in nvidia-smi is a shell script")
    """nvidia-smi lists two GPUs; another process holds 40 GB of GPU 0."""
    env = fake_command(tmp_path, "nvidia-smi", NVIDIA_SMI)
    monkeypatch.setenv("PATH", env["PATH"])
    return env


def test_gpu_usage_reads_memory_and_processes_per_gpu_as_cuda_visible_devices_names_them(two_gpus):
    usage = checks.gpu_usage(["0", "1"])
    assert usage == {"0": dict(memory_used_mib=40321, processes=[dict(pid=4242, name="python3", memory_mib=40310)]),
                     "1": dict(memory_used_mib=1, processes=[])}
    assert checks.gpu_usage(["GPU-bbbb"]) == {"GPU-bbbb": usage["1"]}  # a UUID, as CUDA_VISIBLE_DEVICES may give


def test_gpu_usage_is_empty_without_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert checks.gpu_usage(["0"]) == {}


def test_a_gpu_that_another_process_holds_is_a_warning_with_its_pid_and_mib(two_gpus):
    row = doctor.gpu_memory(["0", "1"])
    assert row["status"] == "warn"
    assert "GPU 0: 40321 MiB in use by pid 4242 python3 (40310 MiB)" in row["detail"]
    assert "GPU 1" not in row["detail"] and "--gpus" in row["todo"]
    assert doctor.gpu_memory(["1"])["status"] == "ok"


def test_memory_held_by_processes_nvidia_smi_cannot_see_is_still_a_warning():
    """Another container's processes are not listed, their memory is."""
    assert checks.busy({"0": dict(memory_used_mib=9000, processes=[])}) == [
        "GPU 0: 9000 MiB in use (by processes not visible here)"]
    assert checks.busy({"0": dict(memory_used_mib=3, processes=[])}) == []


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


# ---- the cause and the fix of a failure's text

# Texts as torch 2.14.1 printed them on this machine (reproduced), or built from the format strings in its
# libraries and in NCCL 2.30.7's (`strings libnccl.so.2`); "Duplicate GPU detected" is older NCCL's.
MESSAGES = [
    ("RuntimeError: [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/device.cc:84] "
     "ifa != nullptr. Unable to find address for: nosuchif", "GLOO_SOCKET_IFNAME"),  # reproduced
    ("NCCL WARN Bootstrap : no socket interface found", "NCCL_SOCKET_IFNAME"),
    ("DistNetworkError: The server socket has failed to listen on any local network address. port: 29500, "
     "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use", "--master-port"),  # reproduced
    ("DistNetworkError: The client socket has timed out after 5000ms while trying to connect to (127.0.0.1, "
     "42263).", "MASTER_ADDR:MASTER_PORT"),  # reproduced: a refused connection, retried until the timeout
    ("gloo/transport/tcp/pair.cc:144] connect [127.0.0.1]:29500: Connection refused", "MASTER_ADDR:MASTER_PORT"),
    ("DistStoreError: Timed out after 6 seconds waiting for clients. 1/2 clients joined.", "peer never arrived"),
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE) ran for "
     "600000 milliseconds before timing out.", "NCCL_P2P_DISABLE=1"),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (run "
     "with NCCL_DEBUG=INFO for details), NCCL version 2.30.7", "NCCL_DEBUG=INFO"),
    ("misc/shmutils.cc:72 NCCL WARN Error: failed to extend /dev/shm/nccl-a1b2c3 to 9637892 bytes, error: No "
     "space left on device (28)", "--shm-size"),
    ("ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory "
     "(shm).", "--shm-size"),
    ("transport/p2p.cc:275 NCCL WARN Cuda failure 'peer access is not supported between these two devices'",
     "NCCL_P2P_DISABLE=1"),
    ("enqueue.cc:1451 NCCL WARN Cuda failure 'invalid argument'", "NCCL_P2P_DISABLE=1"),
    ("init.cc:943 NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000",
     "CUDA_VISIBLE_DEVICES"),
    ("NCCL WARN Multiple Ranks are using the same GPU/Partition. Set NCCL_MULTI_RANK_GPU_ENABLE=1 to "
     "enable this configuration.", "NCCL_MULTI_RANK_GPU_ENABLE=1"),
    ("NCCL WARN Mismatched NCCL version detected : rank 1 version 22809 rank 0 version 23007",
     "same torch on every node"),
    ("NCCL WARN NCCL version mismatch with remote peer 10.0.0.2<41213> (local: 2.30.7, remote "
     "2.28.9)", "same torch on every node"),
    ("NCCL WARN NCCL library is too old. This application was compiled with NCCL version 2.30.7, but is running with "
     "NCCL library version 2.21.5.", "LD_LIBRARY_PATH"),
    ("NCCL WARN P2P is disabled between NVLINK connected GPUs 0 and 1. This should not be the case "
     "given their connectivity, and is probably due to a hardware issue. If you still want to proceed, you can set "
     "NCCL_IGNORE_DISABLED_P2P=1.", "NCCL_IGNORE_DISABLED_P2P=1"),
    ("NCCL WARN Detected mixed local Net device counts across ranks (min 1, max 2). Set "
     "NCCL_IGNORE_NET_MISMATCH=1 to continue.", "NCCL_IGNORE_NET_MISMATCH=1"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
     "139.81 GiB of which 1.19 MiB is free.", "nvidia-smi"),
    ("RuntimeError: ProcessGroupNCCL is only supported with GPUs, no GPUs found!", "CUDA build"),
    ("RuntimeError: The NVIDIA driver on your system is too old (found version 11040).", "update the driver"),
    ("NCCL WARN NET/Plugin: Could not find: libnccl-net.so", "NCCL_DEBUG=INFO"),
]


@pytest.mark.parametrize("text, fix", MESSAGES, ids=[m[0][:40] for m in MESSAGES])
def test_advice_names_the_cause_and_fix_of_real_failure_texts(text, fix):
    said = checks.advice(text)
    assert said != checks.GENERIC_ADVICE and fix in said and "\n" not in said


def test_advice_on_the_harness_own_words_for_a_stopped_run_or_collective_is_the_hang():
    hang = checks.advice("DistStoreError: Timed out after 6 seconds waiting for clients.")
    assert checks.advice("no answer within 60 s:  (log logs/allreduce-n2.log)") == hang  # measurements.run_tool
    assert checks.advice("killed after the 120 s timeout") == hang  # runs_table.status


def test_advice_on_a_text_that_already_carries_advice_answers_its_failure_not_the_advice_words():
    """The harness appends advice to a tool's error; the timeout's names the interface variables, the system
    error's /dev/shm: read again, each must still give its own."""
    for failure in ("no answer within 60 s", "unhandled system error (run with NCCL_DEBUG=INFO for details)"):
        assert checks.advice(f"{failure} (log x.log); {checks.advice(failure)}") == checks.advice(failure)


def test_a_timeout_argument_in_a_traceback_is_not_taken_for_a_timeout():
    log = "  File \"a.py\", line 5\n    dist.init_process_group('gloo', timeout=timedelta(seconds=60))\nValueError: x"
    assert checks.advice(log) == checks.GENERIC_ADVICE


def test_advice_for_an_unknown_failure_says_how_to_see_more():
    assert checks.advice("ValueError: something else went wrong") == checks.GENERIC_ADVICE
    assert "NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL" in checks.GENERIC_ADVICE


def test_the_cause_line_of_a_traceback_is_the_one_that_names_it_even_before_a_blank_end():
    log = "Traceback (most recent call last):\n  File \"x.py\"\nRuntimeError: ... Unable to find address for: eth9\n\n"
    assert checks.cause_line(log) == "RuntimeError: ... Unable to find address for: eth9"


# ---- the machine checks, in-process

def test_interface_settings_that_name_no_interface_are_found(monkeypatch):
    monkeypatch.setattr(checks, "interface_names", lambda: ["lo", "eth0"])
    assert checks.missing_interfaces({"GLOO_SOCKET_IFNAME": "nosuchif,lo"}) == ["GLOO_SOCKET_IFNAME=nosuchif"]
    assert checks.missing_interfaces({"GLOO_SOCKET_IFNAME": "eth"}) == ["GLOO_SOCKET_IFNAME=eth"]  # exact names
    assert checks.missing_interfaces({"NCCL_SOCKET_IFNAME": "eth"}) == []  # NCCL's are prefixes
    assert checks.missing_interfaces({"NCCL_SOCKET_IFNAME": "=eth"}) == ["NCCL_SOCKET_IFNAME=eth"]
    assert checks.missing_interfaces({"NCCL_SOCKET_IFNAME": "^docker,lo"}) == []  # exclusions


def test_little_shared_memory_is_a_warning_and_none_is_not_applicable(monkeypatch):
    monkeypatch.setattr(checks, "shm_free_bytes", lambda: 64 << 20)  # docker's default
    low = doctor.shared_memory()
    assert low["status"] == "warn" and "--shm-size" in low["todo"]
    monkeypatch.setattr(checks, "shm_free_bytes", lambda: None)  # macOS, Windows
    assert doctor.shared_memory()["status"] == "skip" and "n/a" in doctor.shared_memory()["detail"]


def test_a_taken_default_port_is_a_warning(monkeypatch):
    with socket.socket() as server:
        server.bind(("", 0))
        server.listen()
        monkeypatch.setenv("MASTER_PORT", str(server.getsockname()[1]))
        taken = doctor.ports()
    assert taken["status"] == "warn" and "--master-port" in taken["todo"]


def test_topology_counts_the_links_between_the_gpus_used():
    topo = ("\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\nGPU0\t X \tNV18\tSYS\tSYS\t0-7\nGPU1\tNV18\t X \tPIX\tSYS\t0-7\n"
            "GPU2\tSYS\tPIX\t X \tSYS\t8-15\nNIC0\tSYS\tSYS\tSYS\t X \n\nLegend:\n  X    = Self\n")
    assert checks.links(topo, ["0", "1", "2"]) == {"NV18": 1, "SYS": 1, "PIX": 1}
    assert checks.links(topo, ["1", "2"]) == {"PIX": 1}
    assert checks.links("", ["0", "1"]) == {}


def test_runs_that_need_a_failed_collective_or_follow_a_hang_are_skipped_not_run(monkeypatch, tmp_path):
    ran = []

    def run_one(run, settings, out_dir):
        ran.append(run.mode)
        hung = run.mode == "ddp_launch" and settings.max_n == 4
        return dict(status="timeout" if hung else "ok", error="killed after the 120 s timeout" if hung else "",
                    samples_per_s=1.0, wall_s=1.0, log_tail="", log_path="logs/x.log")

    monkeypatch.setattr(runs_table, "run_one", run_one)
    args = doctor.parse_args(["--cpu", "2"])
    rows = doctor.training_rows(doctor.doctor_settings([], args, str(tmp_path)), str(tmp_path), failed_n={2})
    assert ran == [m for m in MODES if not MODES[m].collective]  # 01 and 02 at n = 1
    skipped = [r for r in rows if r["status"] == "skip" and "all-reduce at n=2 failed" in r["detail"]]
    assert len(skipped) == sum(MODES[m].collective for m in MODES if not doctor.plan.unavailable_reason(m))

    ran.clear()
    args = doctor.parse_args(["--cpu", "4"])
    rows = doctor.training_rows(doctor.doctor_settings([], args, str(tmp_path)), str(tmp_path), failed_n=set())
    assert "ddp_launch" in ran and "ddp_spawn" not in ran  # after 03's hang, no other run waits for its timeout
    assert any("timed out" in r["detail"] for r in rows if r["status"] == "skip")


def test_without_lightning_its_run_is_skipped_saying_how_to_install_it(monkeypatch, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "lightning" else find_spec(name, *args))
    monkeypatch.setattr(runs_table, "run_one", lambda run, settings, out_dir: dict(
        status="ok", error="", samples_per_s=1.0, wall_s=1.0, log_tail="", log_path="logs/x.log"))
    rows = doctor.training_rows(doctor.doctor_settings([], doctor.parse_args([]), str(tmp_path)), str(tmp_path), set())
    lightning = next(r for r in rows if r["check"] == "train 07 lightning")
    assert lightning["status"] == "skip" and "pip install lightning" in lightning["detail"]
    assert all(r["status"] == "ok" for r in rows if r is not lightning)


@pytest.mark.parametrize("args, says", [(["--cpu", "0"], "at least 1"), (["--gpus", "0"], "does not exist"),
                                        (["--json", "/no/such/folder/d.json"], "cannot write --json"),
                                        (["--json", "."], "cannot write --json"),
                                        (["--bogus"], "unrecognized")])
def test_bad_arguments_are_one_line_and_exit_2(args, says):
    result = run([sys.executable, "bench/doctor.py", *args], timeout=120, check=False)
    assert result.returncode == 2 and says in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""
    assert not os.path.exists("/no/such/folder")
