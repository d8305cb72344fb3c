"""The CUDA paths: run on a GPU machine (`python -m pytest -q -m gpu tests`); skipped where there is no GPU."""
import json
import os
import warnings

import pytest
import torch

from helpers import TORCHRUN, free_port, load_script, run, script_command, start, stop

pytestmark = pytest.mark.gpu


# The other tests hide the GPUs from the scripts they start; these give them back: the ones this process was
# given, else every one it sees. TF32 off (cuDNN's convolutions use it by default), so that the comparisons of
# modes below hold float32's tolerance, not TF32's.
GPUS = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES",
                                               ",".join(map(str, range(torch.cuda.device_count())))),
        "NVIDIA_TF32_OVERRIDE": "0"}


# Each run's and node's wait: 3 x the slowest start-up measured on an H200 (18 s), inside the GPU check's bound
# of its step (bench/gpu_check.py: 162 s for these tests, 81-130 s for the two hosts ones).
RUN_TIMEOUT_S, PEER_TIMEOUT_S = 60, 20


def train(script, out, *args, nprocs=None):
    out.mkdir()
    run(script_command(script, "--synthetic", "--max-steps", 4, "--log-interval", 0, "--no-dropout",
                       "--metrics-json", out / "m.json", "--save-model", out / "model.pt", *args, nprocs=nprocs),
        timeout=RUN_TIMEOUT_S, env=GPUS)
    return json.loads((out / "m.json").read_text()), torch.load(out / "model.pt", map_location="cpu")


B = 32  # per GPU: every global batch is B x the GPU count, whatever that count is


def test_every_mode_trains_on_cuda_and_reports_gpu_memory(tmp_path):
    gpus = torch.cuda.device_count()
    ids = ",".join(map(str, range(gpus)))
    runs = {"01": train("01_single_gpu.py", tmp_path / "01", "--batch-size", B * gpus),
            "02": train("02_data_parallel.py", tmp_path / "02", "--batch-size", B * gpus, "--gpus", ids),
            "03": train("03_ddp_launch.py", tmp_path / "03", "--batch-size", B, nprocs=gpus),
            "04": train("04_ddp_spawn.py", tmp_path / "04", "--batch-size", B, "--nprocs", gpus),
            # 06's snapshot gathers every rank's RNG state: an object collective, on each rank's own GPU
            "06": train("06_fault_tolerant.py", tmp_path / "06", "--batch-size", B, "--snapshot",
                        tmp_path / "06-snapshot.pt", nprocs=gpus)}
    for name, (record, _) in runs.items():
        assert record["device_type"] == "cuda", name
        assert 0 < record["peak_memory_bytes"] < torch.cuda.get_device_properties(0).total_memory, name
        assert record["global_batch"] == B * gpus and record["samples_per_s"] > 0, name
    per_gpu = runs["02"][0]["epochs_detail"][0]["peak_memory_per_device"]
    assert len(per_gpu) == gpus and runs["02"][0]["peak_memory_bytes"] == max(per_gpu)  # DataParallel: each GPU
    assert runs["03"][0]["backend"] == runs["04"][0]["backend"] == runs["06"][0]["backend"] == "nccl"
    assert (tmp_path / "06-snapshot.pt").exists()
    # Same global batch, same update, on the GPU too. cuDNN's convolution backward is not deterministic (atomic
    # adds), so two runs of the same script differ slightly and the differences grow with every step: compare
    # after a few steps only (after 30, 02 was already outside this tolerance on an H200).
    for name, (_, weights) in runs.items():
        for key, tensor in runs["01"][1].items():
            torch.testing.assert_close(weights[key], tensor, rtol=1e-3, atol=1e-4, msg=f"{name}: {key}")


def test_a_training_step_never_waits_for_the_gpu(quick_mnist_dir):
    """Synchronisations per epoch, counted by CUDA's sync debug mode: as many for 12 steps as for 4."""
    single = load_script("01_single_gpu.py")
    args = single.parse_args(["--data-dir", str(quick_mnist_dir), "--log-interval", "0"])
    world = single.setup(args)
    net = single.Net().to(world.device)
    optimizer = torch.optim.Adadelta(net.parameters())
    epochs = []

    def synchronisations(steps):
        args.max_steps = steps
        training, _ = single.load_data(args, 0, 1, world.device)
        batches = single.timed(training(len(epochs) + 1), world, epochs)  # measured too
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                single.train_epoch(net, batches, optimizer, args, world, epoch=len(epochs) + 1)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message) for w in caught)

    synchronisations(8)  # the first epoch also pays for start-up, and its warm-up steps wait on purpose
    assert synchronisations(12) == synchronisations(4)


# ---- two ranks on one GPU: the multi-process CUDA paths on a machine with a single GPU (the GPU check runs them
# as a step of their own: -m two_hosts)

def as_two_hosts(node_command, out, timeout=RUN_TIMEOUT_S):
    """node_command(r) for r = 0, 1 at once, both on GPU 0 of this machine, each told by NCCL_HOSTID that it is a
    host of its own: NCCL refuses two ranks of one host on one GPU ("Multiple Ranks are using the same GPU"), unless,
    from NCCL 2.30 on, NCCL_MULTI_RANK_GPU_ENABLE=1; a host each works with every NCCL the suite admits, and the
    ranks then talk as two machines' do. Returns rank 0's metrics record."""
    out.mkdir()
    node1 = start(node_command(1), env={**GPUS, "NCCL_HOSTID": "gpu-check-host-1"})
    try:
        run(node_command(0), timeout=timeout, env={**GPUS, "NCCL_HOSTID": "gpu-check-host-0"})
        assert node1.wait(timeout=PEER_TIMEOUT_S) == 0, node1.communicate()
    finally:
        stop([node1])  # its group: node1.kill() would end torchrun's agent and leave its worker on the GPU
    record = json.loads((out / "m.json").read_text())
    assert (record["device_type"], record["world_size"], record["backend"]) == ("cuda", 2, "nccl"), record
    return record


def torchrun_node(script, rank, port, *args):
    """One of two torchrun agents on this host, one process each: two "nodes" as 05 has them."""
    return [*TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank), "--master_addr",
            "127.0.0.1", "--master_port", str(port), script, *map(str, args)]


SHORT = ["--synthetic", "--max-steps", 20, "--log-interval", 0]


@pytest.mark.two_hosts
def test_05_trains_as_two_nodes_on_one_gpu(tmp_path):
    port = free_port()
    as_two_hosts(lambda r: script_command("05_multinode_mnist.py", "-n", 2, "-g", 1, "--nr", r, "--master-port",
                                          port, *SHORT, "--metrics-json", tmp_path / "05" / "m.json"), tmp_path / "05")


@pytest.mark.two_hosts
def test_06_snapshots_gather_every_ranks_state_on_its_own_gpu(tmp_path):
    """06's snapshot gathers the ranks' RNG states with an object collective: on the current device of each."""
    port = free_port()
    snapshot = tmp_path / "snapshot.pt"
    as_two_hosts(lambda r: torchrun_node("06_fault_tolerant.py", r, port, *SHORT, "--snapshot", snapshot,
                                         "--metrics-json", tmp_path / "06" / "m.json"), tmp_path / "06")
    assert snapshot.exists()


@pytest.mark.two_hosts
def test_07_trains_with_lightning_as_two_nodes_on_one_gpu(tmp_path):
    pytest.importorskip("lightning")
    port = free_port()
    as_two_hosts(lambda r: torchrun_node("07_lightning.py", r, port, *SHORT, "--devices", 1, "--num-nodes", 2,
                                         "--metrics-json", tmp_path / "07" / "m.json"), tmp_path / "07")
