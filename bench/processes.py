"""Start one command's processes at once, each in a process group of its own; stop all they spawned at any end."""
import contextlib
import os
import pathlib
import shlex
import signal
import subprocess
import threading
import time

from bench.machine import output_of
from bench import REPO

KILL_GRACE_S = 5  # SIGTERM first so that process groups can be destroyed cleanly, then SIGKILL
PEER_GRACE_S = 15  # once one node of 05 has failed, the other would only wait for its rendezvous timeout
STOP = threading.Event()  # set: the runs under way in other threads stop as after Ctrl-C (the doctor's)
# Launchers' and schedulers' variables, which no run inherits: else Lightning (07) and torch take the harness's job.
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PMI_", "OMPI_COMM_WORLD_")
LAUNCHER_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"}


def run_environment(env):
    """This process's environment less what launchers set, then env: a run sees only the launch the harness made."""
    inherited = {k: v for k, v in os.environ.items()
                 if k not in LAUNCHER_VARIABLES and not k.startswith(LAUNCHER_PREFIXES)}
    return {**inherited, "PYTHONUNBUFFERED": "1", **env}


def stop(procs, grace=KILL_GRACE_S):
    """SIGTERM, then SIGKILL grace seconds later, to whole process groups: else torchrun or spawn leave workers."""
    if os.name == "nt":  # Windows has neither process groups nor SIGKILL: taskkill /T ends a process and its tree
        for p in procs:
            subprocess.run(["taskkill", "/T", "/F", "/PID", str(p.pid)], capture_output=True)
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # the leader may be gone, not its children
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + grace
        for p in procs:  # after SIGKILL too, which is sent, not done: reaped, it has an exit code and left /proc
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0, deadline - time.monotonic()))


def run_processes(cmds, log_paths, timeout, grace=KILL_GRACE_S):
    """Run [(environment, argv)] at once, each into its log; (exit code, timed out). Any end, Ctrl-C too, stops them."""
    procs = []
    try:
        for (env, argv), log_path in zip(cmds, log_paths):
            pathlib.Path(log_path).write_text(f"$ {shlex.join(argv)}\n")
            with open(log_path, "a") as log:
                procs.append(subprocess.Popen(argv, cwd=REPO, env=run_environment(env),
                                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
        deadline, give_up, timed_out = time.monotonic() + timeout, float("inf"), False
        while any(p.poll() is None for p in procs) and not timed_out and time.monotonic() < give_up:
            if give_up == float("inf") and any(p.poll() not in (None, 0) for p in procs):
                give_up = time.monotonic() + PEER_GRACE_S
            time.sleep(0.1)
            timed_out = time.monotonic() > deadline
            if STOP.is_set():
                raise KeyboardInterrupt
    finally:
        stop(procs, grace)  # also after a clean exit: children a script left behind must not hold ports or cores
    return next((p.poll() for p in procs if p.poll() != 0), 0), timed_out


def log_tail(paths, lines=15):
    return "\n---\n".join("\n".join(pathlib.Path(p).read_text(errors="replace").splitlines()[-lines:]) for p in paths)


def processes_mentioning(text):
    """[(pid, command)] of the other processes whose command line holds text; none on Windows, which has no `ps`."""
    listed = output_of(["ps", "-axww", "-o", "pid=,args="]) or ""  # ww: whole lines, not cut at $COLUMNS
    rows = [line.strip().split(None, 1) for line in listed.splitlines() if text in line]
    return [(int(pid), command) for pid, command in rows if int(pid) != os.getpid()]
