"""The doctor's checks and those it shares with the harness (bench/checks.py), in this process with stand-ins: a
collective that does not answer, busy GPUs from a stand-in nvidia-smi, the cause and fix of a failure's text,
interfaces, shared memory, ports, topology, and the runs it skips (the doctor run as a user runs it:
tests/integration/test_doctor.py)."""
import importlib.util
import re
import socket
import time

import pytest

from bench import checks, doctor, measurements, sweep
from bench.commands import commands
from bench.processes import KILL_GRACE_S
from bench.family import MODES
from helpers import ROOT, busy_note, fake_command, slack


def collective_rows_in(tmp_path):
    """The doctor's all-reduce rows on this CPU, its logs under tmp_path: (rows, the n where it failed)."""
    (tmp_path / "logs").mkdir()
    return doctor.collective_rows(doctor.doctor_settings([], doctor.parse_args([]), str(tmp_path)), str(tmp_path))


def test_a_collective_that_does_not_answer_in_time_fails_with_the_hang_advice_at_the_bound(monkeypatch, tmp_path):
    """A hung all-reduce, stood in for by the bound cut to 1 s (the tool's start-up alone takes longer)."""
    monkeypatch.setattr(measurements, "COLLECTIVE_TIMEOUT_S", 1)
    started = time.monotonic()
    rows, failed = collective_rows_in(tmp_path)
    assert failed == {2} and rows[0]["status"] == "FAIL" and "no answer within 1 s" in rows[0]["detail"]
    assert rows[0]["todo"] == checks.advice("Timed out") and "NCCL_P2P_DISABLE=1" in rows[0]["todo"]
    took = time.monotonic() - started  # the bound, then SIGTERM and SIGKILL, then starting and reading the tool
    assert took < 1 + 2 * KILL_GRACE_S + slack(5), f"{took:.1f} s ({busy_note()})"


def test_a_collective_that_exits_0_without_its_result_is_a_failed_row_not_a_traceback(monkeypatch, tmp_path):
    """Its JSON never written: the doctor's row still says why and names the log. The tool stands in as a run
    that exits 0 at once: the real one is started in tests/integration/test_doctor.py."""
    def exits_0(commands, logs, timeout):
        for log in logs:
            open(log, "w").write("all-reduce done\n")
        return 0, False
    monkeypatch.setattr(measurements, "run_processes", exits_0)
    rows, failed = collective_rows_in(tmp_path)
    assert failed == {2} and rows[0]["status"] == "FAIL", rows
    assert "no result in" in rows[0]["detail"] and "allreduce-n2.log" in rows[0]["detail"], rows


# ---- busy GPUs, through a stand-in nvidia-smi (the fixture two_gpus)

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


# ---- GPUs that torch's newer releases have no build for, their compute capability from a stand-in nvidia-smi

CAPABILITIES = "--query-gpu=index,uuid,compute_cap --format=csv,noheader"  # what the doctor asks nvidia-smi
V100_AND_H200 = [("0", "Tesla V100-SXM2-16GB"), ("1", "NVIDIA H200")]
PIN = ("torch 2.15 and later have no build for compute capability 7.0 (GPU 0): the last release that runs there is "
       "2.14, so pin torch<2.15")


def devices_row(tmp_path, gpus, torch_version, cuda="True"):
    settings = doctor.doctor_settings(gpus, doctor.parse_args([]), str(tmp_path))
    return doctor.devices(gpus, settings, dict(torch_version=torch_version, is_cuda_available=cuda))


@pytest.mark.parametrize("torch_version, cuda, status", [("2.14.1+cu126", "True", "warn"),
                                                         ("2.15.0+cu128", "True", "FAIL"),
                                                         ("2.15.0+cu128", "False", "FAIL"),
                                                         ("2.14.1+cpu", "False", "FAIL")])
def test_a_gpu_below_compute_capability_7_5_is_told_that_torch_2_14_is_its_last(torch_version, cuda, status,
                                                                                 tmp_path, monkeypatch):
    """A V100 (7.0): torch 2.14 still runs there, a warning; 2.15 has no build for it, a failure. The one line to
    do is the pin, whatever else the row says."""
    answers = {CAPABILITIES: "0, GPU-aaaa, 7.0\n1, GPU-bbbb, 9.0"}
    monkeypatch.setenv("PATH", fake_command(tmp_path, "nvidia-smi", answers)["PATH"])
    said = devices_row(tmp_path, V100_AND_H200, torch_version, cuda)
    assert said["status"] == status and said["todo"].endswith(PIN) and "\n" not in said["todo"], said
    assert "compute capability 7.0 (GPU 0)" in said["detail"] or "cannot use CUDA" in said["detail"], said
    h200 = devices_row(tmp_path, V100_AND_H200[1:], torch_version, cuda)  # 9.0: every release has a build
    assert "capability" not in h200["detail"] + h200["todo"], h200
    assert h200["status"] == ("ok" if cuda == "True" else "FAIL")


def test_where_nvidia_smi_cannot_tell_the_capability_the_doctor_claims_nothing(tmp_path, monkeypatch):
    """A driver before R510 has no compute_cap: the stand-in fails that query, as such an nvidia-smi does."""
    monkeypatch.setenv("PATH", fake_command(tmp_path, "nvidia-smi", {})["PATH"])
    assert checks.compute_capabilities(["0"]) == {}
    assert devices_row(tmp_path, V100_AND_H200[:1], "2.15.0+cu128")["status"] == "ok"


@pytest.mark.parametrize("torch_version, status", [("2.11.0+cu130", "warn"), ("2.12.1", "warn"),
                                                    ("2.13.0+cpu", "ok"), ("2.14.1+cu130", "ok"), ("2.15.0", "ok")])
def test_a_torch_older_than_the_requirements_floor_is_a_warning(torch_version, status):
    """A lent H200 had torch 2.11, below requirements.txt's 2.13, and the doctor said ok: there 10 stopped at its
    first step. The floor is read from requirements.txt, so raising it there raises it here."""
    said = doctor.versions(dict(torch_version=torch_version, torchvision_version="0.29.1", python_version="3.11.7"))
    assert said["status"] == status, said
    assert ("pip install -r requirements.txt" in said["todo"]) == (status == "warn"), said


# ---- the cause and the fix of a failure's text

# Texts as torch 2.14.1 printed them on this machine (reproduced), or built from the format strings in its
# libraries and in NCCL 2.30.7's (`strings libnccl.so.2`); "Duplicate GPU detected" is older NCCL's. Those marked
# torch 2.15's are its new wording of the same failures, from its release notes (not installable here).
WATCHDOG = {"2.14": "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE) ran "
                    "for 600000 milliseconds before timing out.",
            "2.15": "Watchdog caught collective operation timeout: NCCL operation timed out"}
NO_GPU = {"2.14": "RuntimeError: ProcessGroupNCCL is only supported with GPUs, no GPUs found!",
          "2.15": "nccl2 requires at least one CUDA device"}
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
    (WATCHDOG["2.14"], "NCCL_P2P_DISABLE=1"),
    (WATCHDOG["2.15"], "NCCL_P2P_DISABLE=1"),  # torch 2.15's
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
    (NO_GPU["2.14"], "CUDA build"),
    (NO_GPU["2.15"], "CUDA build"),  # torch 2.15's
    ("RuntimeError: The NVIDIA driver on your system is too old (found version 11040).", "update the driver"),
    ("NCCL WARN NET/Plugin: Could not find: libnccl-net.so", "NCCL_DEBUG=INFO"),
]


@pytest.mark.parametrize("text, fix", MESSAGES, ids=[m[0][:40] for m in MESSAGES])
def test_advice_names_the_cause_and_fix_of_real_failure_texts(text, fix):
    said = checks.advice(text)
    assert said != checks.GENERIC_ADVICE and fix in said and "\n" not in said


@pytest.mark.parametrize("texts", [WATCHDOG, NO_GPU], ids=["the watchdog's timeout", "nccl without a GPU"])
def test_torch_2_14_and_2_15_words_for_one_failure_get_one_cause_and_fix(texts):
    assert checks.advice(texts["2.14"]) == checks.advice(texts["2.15"]) != checks.GENERIC_ADVICE


def test_advice_on_the_harness_own_words_for_a_stopped_run_or_collective_is_the_hang():
    hang = checks.advice("DistStoreError: Timed out after 6 seconds waiting for clients.")
    assert checks.advice("no answer within 60 s:  (log logs/allreduce-n2.log)") == hang  # measurements.run_tool
    assert checks.advice("killed after the 120 s timeout") == hang  # sweep.status


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


# ---- the machine checks

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
        ran.append(("start", run.mode))
        hung = run.mode == "ddp_launch" and settings.max_n == 4
        time.sleep(0.05 if hung else 0.01)
        ran.append(("end", run.mode))
        return dict(status="timeout" if hung else "ok", error="killed after the 120 s timeout" if hung else "",
                    samples_per_s=1.0, wall_s=1.0, log_tail="", log_path="logs/x.log")

    monkeypatch.setattr(sweep, "run_one", run_one)
    args = doctor.parse_args(["--cpu", "2"])
    rows = doctor.training_rows(doctor.doctor_settings([], args, str(tmp_path)), str(tmp_path), failed_n={2})
    assert sorted(m for e, m in ran if e == "start") == sorted(m for m in MODES if not MODES[m].collective)  # n=1
    skipped = [r for r in rows if r["status"] == "skip" and "all-reduce at n=2 failed" in r["detail"]]
    assert len(skipped) == sum(MODES[m].collective for m in MODES
                               if not doctor.plan.unavailable_reason(m) and m != "fsdp_tp")  # 11: no run at n = 2
    assert [r["check"] for r in rows] == [f"train {MODES[m].script[:2]} {m}" for m in MODES]  # in order

    ran.clear()
    args = doctor.parse_args(["--cpu", "4"])
    rows = doctor.training_rows(doctor.doctor_settings([], args, str(tmp_path)), str(tmp_path), failed_n=set())
    # Once 03 has hung, no run starts to wait for a timeout too; those beside it ran while it waited.
    after = ran[ran.index(("end", "ddp_launch")):]
    assert ("start", "ddp_launch") in ran and not [m for e, m in after if e == "start"], ran
    assert any("timed out" in r["detail"] for r in rows if r["status"] == "skip")
    assert [r["check"] for r in rows] == [f"train {MODES[m].script[:2]} {m}" for m in MODES]


@pytest.mark.parametrize("cpu, gpus", [(1, 0), (2, 0), (3, 0), (4, 0), (8, 0), (None, 1), (None, 2), (None, 8)])
def test_every_training_run_of_the_doctor_takes_steps_past_the_scripts_warm_up(cpu, gpus, tmp_path):
    """Its samples/s leaves the warm-up steps out: a run of no more steps times only warm-up (n = 2 had fallen to
    3 steps once). The steps as the commands the doctor builds give them, no run."""
    args = doctor.parse_args(["--cpu", str(cpu)] if cpu else [])
    settings = doctor.doctor_settings([(str(i), "NVIDIA H200") for i in range(gpus)], args, str(tmp_path))
    largest, _ = doctor.largest_runs(settings)
    assert largest, "the doctor trains no mode"
    for mode, run in largest.items():
        script = (ROOT / MODES[mode].script).read_text()
        warm_up = int(re.search(r"^WARMUP_STEPS = (\d+)", script, re.M).group(1))
        [(_, argv), *_] = commands(run, settings, tmp_path / "m.json", tmp_path / "s.pt")
        flag = lambda name: int(argv[argv.index(name) + 1])  # noqa: E731
        processes = run.n if MODES[mode].collective else 1  # each with its share of the images
        steps = min(flag("--max-steps"), -(-doctor.TRAIN_IMAGES // processes) // flag("--batch-size"))
        assert steps > warm_up, f"{mode} at n = {run.n}: {steps} steps, {warm_up} of them warm-up ({argv})"


def test_without_lightning_its_run_is_skipped_saying_how_to_install_it(monkeypatch, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "lightning" else find_spec(name, *args))
    monkeypatch.setattr(sweep, "run_one", lambda run, settings, out_dir: dict(
        status="ok", error="", samples_per_s=1.0, wall_s=1.0, log_tail="", log_path="logs/x.log"))
    rows = doctor.training_rows(doctor.doctor_settings([], doctor.parse_args([]), str(tmp_path)), str(tmp_path), set())
    lightning = next(r for r in rows if r["check"] == "train 07 lightning")
    assert lightning["status"] == "skip" and "pip install lightning" in lightning["detail"]
    assert all(r["status"] == "ok" for r in rows if r is not lightning and r["check"] != "train 11 fsdp_tp")  # n = 4
