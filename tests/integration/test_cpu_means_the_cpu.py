"""--cpu means the CPU on every machine. On a machine with CUDA GPUs, or a Mac, torch's own defaults (the mesh
fully_shard builds when given none, a barrier's device, the device of object collectives) and Lightning's take the
accelerator that is there, whatever --cpu says. Here every numbered script runs with --cpu as a user starts it (the
DDP ones with 2 processes, 05 as two nodes, 07 with 2 devices) under a stand-in CUDA and a stand-in MPS: torch
reports the accelerator in every process, and any call that would use a device fails and is logged."""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import ROOT, by_script, free_port, run, run_two_nodes, script_command, with_stand_in_accelerator

SCRIPTS = sorted(path.name for path in ROOT.glob("[0-9][0-9]_*.py"))
PROCESSES = {"01_single_gpu.py": 1, "02_data_parallel.py": 1}  # the others: 2


def train_on_the_cpu(name, kind, mnist_dir, tmp_path):
    """The records and the hook's log of `name` run with --cpu under a stand-in `kind` (06 twice: its second run
    resumes the first's snapshot for one epoch more, through the object collectives)."""
    env, log = with_stand_in_accelerator(tmp_path, kind)
    common = ["--cpu", "--data-dir", mnist_dir, "--max-steps", 2, "--log-interval", 0, "--threads", 1]
    port_flag = by_script(name).launch.port_flag  # 04: runs at once each meet at a free port, not at 29500
    common += [port_flag, free_port()] if port_flag else []
    n = PROCESSES.get(name, 2)
    records = []
    for attempt in range(2 if name == "06_fault_tolerant.py" else 1):
        record = tmp_path / f"record-{attempt}.json"
        args = [*common, "--metrics-json", record, "--epochs", 1 + attempt]
        if name == "06_fault_tolerant.py":
            args += ["--snapshot", tmp_path / "snapshot.pt", "--snapshot-every", 1]
        if name == "05_multinode_mnist.py":
            run_two_nodes(*args, gpus=1, timeout=240, env=env)
        else:
            run(script_command(name, *args, nprocs=None if n == 1 else n), timeout=240, env=env)
        records.append(json.loads(record.read_text()))
    return records, log.read_text().splitlines()


KINDS = ["cuda", "mps"]
AT_ONCE = 2  # runs at a time: a short run waits mostly on its start-up, so two share the 2 cores well


@pytest.fixture(scope="module")
def trained(quick_mnist_dir, tmp_path_factory, request):
    """{(script, kind): its records and log, or the failure it raised}, every selected run AT_ONCE at a time."""
    def one(key):
        try:
            return train_on_the_cpu(*key, quick_mnist_dir, tmp_path_factory.mktemp("-".join(key)))
        except BaseException as failure:  # raised again by this run's own test
            return failure
    keys = [(item.callspec.params["name"], item.callspec.params["kind"]) for item in request.session.items
            if item.module is request.module]
    with ThreadPoolExecutor(AT_ONCE) as pool:
        return dict(zip(keys, pool.map(one, keys)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_with_cpu_trains_on_the_cpu_beside_an_accelerator(name, kind, trained):
    if isinstance(trained[name, kind], BaseException):
        raise trained[name, kind]
    records, log = trained[name, kind]
    used = [line for line in log if " used " in line]
    assert used == [], f"{name} --cpu used the stand-in {kind}: {used}"
    started = [line for line in log if " used " not in line and " queried " not in line]
    assert len(started) >= PROCESSES.get(name, 2) * len(records), log  # the hook ran in every process
    for record in records:
        assert (record["device_type"], record["world_size"]) == ("cpu", PROCESSES.get(name, 2)), record
        assert record["backend"] in (None, "gloo"), record
