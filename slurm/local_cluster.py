"""A private SLURM cluster of two nodes on this host, to try slurm/multinode.sbatch before queueing on a real one.

    sudo python slurm/local_cluster.py start /tmp/cluster     # prints the SLURM_CONF line to export
    export SLURM_CONF=/tmp/cluster/slurm.conf
    PROCS_PER_NODE=2 sbatch --wait --gpus-per-node=0 --cpus-per-task=2 slurm/multinode.sbatch --cpu --synthetic
    sudo python slurm/local_cluster.py stop /tmp/cluster

Everything lives in the folder: slurm.conf, state, spool, logs, and a munged with its own key and socket, so
nothing of the host's SLURM or munge is used or touched. The nodes are named 127.0.0.1 and 127.0.0.2: node
names are what the batch script gives 05 as the master address, and these resolve without editing /etc/hosts.
Needs root (slurmd starts jobs as the user who submitted them) and Debian's slurm-wlm and munge packages.
Tests use it as a context manager: `with local_cluster(folder) as env: subprocess.run(["sbatch", ...], env=env)`.
"""
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

NODES = ["127.0.0.1", "127.0.0.2"]
COMMANDS = ["munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel"]
START_TIMEOUT_S = 30
STOP_TIMEOUT_S = 10


def which(name):
    """The program's path; daemons live in sbin, which a user's PATH may lack."""
    return shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin")


def missing_requirements():
    """Why this host cannot run the cluster, in one line, or None."""
    missing = [name for name in COMMANDS if not which(name)]
    if missing:
        return f"SLURM or munge is not installed (no {', '.join(missing)}): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "needs root: slurmd starts each job as the user who submitted it"
    return None


def free_ports(count):
    """Ports nobody listens on now, for slurmctld and one slurmd per node (several slurmds share this host)."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def write_config(folder, ports):
    """slurm.conf for this folder: plugins that need no cgroups, database or mail; one slurmd port per node."""
    cpus = len(os.sched_getaffinity(0))  # each "node" is this host, so it offers the host's cores
    host = socket.gethostname().split(".")[0]  # slurmctld refuses to start on a host not named here
    lines = [
        "ClusterName=local",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ports[0]}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={folder}/munge/munge.socket",
        f"StateSaveLocation={folder}/state",
        f"SlurmdSpoolDir={folder}/spool/%n",  # %n: each slurmd of this host gets its own
        f"SlurmctldPidFile={folder}/slurmctld.pid",
        f"SlurmdPidFile={folder}/slurmd-%n.pid",
        f"SlurmctldLogFile={folder}/log/slurmctld.log",
        f"SlurmdLogFile={folder}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",  # no cgroups in containers and CI runners
        "TaskPlugin=task/affinity",  # binds each task to its CPUs, as most clusters do
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",  # trust the CPUs below, whatever hwloc finds in a container
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "MinJobAge=5",  # sbatch --wait polls every 2 s only while that is under MinJobAge/2; else up to 32 s
    ]
    for node, port in zip(NODES, ports[1:]):
        lines.append(f"NodeName={node} Port={port} CPUs={cpus} State=UNKNOWN")
    lines.append("PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    (folder / "slurm.conf").write_text("\n".join(lines) + "\n")


def write_munge_key(folder):
    """A fresh key that only this cluster's munged knows; munged insists that only its owner can read it."""
    munge = folder / "munge"
    munge.mkdir(mode=0o755)  # clients must reach the socket in here
    fd = os.open(munge / "munge.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(128))


def environment(folder):
    """The environment for SLURM's commands (sbatch, squeue, ...) to reach this cluster and not another."""
    return {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}


def start_daemon(folder, name, command):
    """One daemon in the foreground of its own session, so that it outlives `start` and its pid is the daemon's."""
    with open(folder / "log" / f"{name}.out", "wb") as out:
        process = subprocess.Popen([which(command[0]), *command[1:]], stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, env=environment(folder), start_new_session=True)
    pids = read_pids(folder)
    pids[name] = process.pid
    (folder / "pids.json").write_text(json.dumps(pids))


def read_pids(folder):
    path = folder / "pids.json"
    return json.loads(path.read_text()) if path.exists() else {}


def wait_for(condition, what, folder, timeout=START_TIMEOUT_S):
    """Wait until condition() holds; a daemon that exits meanwhile is reported at once with its last line."""
    deadline = time.monotonic() + timeout
    while not condition():
        for name, pid in read_pids(folder).items():
            if not running(pid, name):
                lines = (folder / "log" / f"{name}.out").read_text().splitlines() or ["(no output)"]
                raise RuntimeError(f"local cluster: {name} exited: {lines[-1]} (see {folder}/log)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"local cluster: {what} not ready after {timeout} s; see {folder}/log")
        time.sleep(0.2)


def nodes_idle(folder):
    result = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=environment(folder), capture_output=True,
                            text=True, timeout=10)
    return result.returncode == 0 and result.stdout.split() == ["idle"] * len(NODES)


def start(folder):
    """Start munged, slurmctld and one slurmd per node in an empty folder; return when the nodes are idle."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise RuntimeError(f"local cluster: {folder} is not empty (stop the cluster there, or use a new folder)")
    for sub in ["state", "log", *(f"spool/{node}" for node in NODES)]:
        (folder / sub).mkdir(parents=True)
    write_munge_key(folder)
    write_config(folder, free_ports(1 + len(NODES)))
    munge = folder / "munge"
    # --force: munged wants every folder above its socket open to all, and this folder may be a private one
    # (a home, pytest's); only this cluster's daemons and commands, run by the same user, use the socket.
    start_daemon(folder, "munged", ["munged", "--foreground", "--force", f"--key-file={munge}/munge.key",
                                    f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
                                    f"--log-file={folder}/log/munged.log", f"--seed-file={munge}/munged.seed"])
    wait_for((munge / "munge.socket").exists, "munged", folder)
    conf = str(folder / "slurm.conf")
    start_daemon(folder, "slurmctld", ["slurmctld", "-D", "-f", conf])
    for node in NODES:
        start_daemon(folder, f"slurmd-{node}", ["slurmd", "-D", "-f", conf, "-N", node])
    wait_for(lambda: nodes_idle(folder), f"nodes {', '.join(NODES)}", folder)
    return environment(folder)


def running(pid, name):
    """Whether pid is still our daemon: not gone, not a zombie, not a recycled pid of another program."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()  # "PID (COMM) STATE ..."; cmdline can read empty at start
    except OSError:
        return False
    command, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
    return state != "Z" and command == name.split("-")[0]


def cancel_jobs(folder):
    """Cancel what still runs, so that no job step outlives the daemons that manage it."""
    env = environment(folder)
    subprocess.run(["scancel", "--full", f"--user={os.getuid()}"], env=env, capture_output=True, timeout=10)
    for _ in range(STOP_TIMEOUT_S * 5):
        queue = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=10)
        if queue.returncode != 0 or not queue.stdout.strip():
            return
        time.sleep(0.2)


def reap(pid):
    """Collect the exit status of a daemon this process started (context manager), so no zombie is left."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:  # (0, 0): still exiting
            time.sleep(0.05)
    except ChildProcessError:
        pass  # started by another process (`start` on the command line): init collects it


def stop(folder):
    """Stop the daemons that `start` recorded, by pid: SLURM's first (they need munge to shut down), then munged."""
    folder = Path(folder).resolve()
    pids = read_pids(folder)
    if pids.get("slurmctld") and running(pids["slurmctld"], "slurmctld"):
        cancel_jobs(folder)
    terminate({name: pid for name, pid in pids.items() if name != "munged"})
    terminate({name: pid for name, pid in pids.items() if name == "munged"})
    (folder / "pids.json").unlink(missing_ok=True)


def terminate(pids):
    """SIGTERM, then SIGKILL for any that linger."""
    for name, pid in pids.items():
        if running(pid, name):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(running(pid, name) for name, pid in pids.items()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for name, pid in pids.items():
        if running(pid, name):
            os.kill(pid, signal.SIGKILL)
        reap(pid)


@contextlib.contextmanager
def local_cluster(folder):
    """The cluster for the duration of a with block; its daemons are stopped however the block ends."""
    try:
        yield start(folder)
    finally:
        stop(folder)


def main(argv):
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        sys.exit("usage: python slurm/local_cluster.py start|stop FOLDER")
    action, folder = argv
    if action == "start":
        reason = missing_requirements()
        if reason:
            sys.exit(f"local cluster: {reason}")
        try:
            start(folder)
        except RuntimeError as e:
            stop(folder)
            sys.exit(str(e))
        print(f"export SLURM_CONF={Path(folder).resolve() / 'slurm.conf'}")
    else:
        stop(folder)


if __name__ == "__main__":
    main(sys.argv[1:])
