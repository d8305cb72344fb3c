"""Bad input: one clear line on stderr, a non-zero exit, no traceback, and nothing already written is damaged
(the data, an existing snapshot, metrics file or results folder are byte-identical afterwards). Each case started
as a user starts it; the bad flags refused when they are parsed: tests/unit/test_bad_flags.py."""
import shutil
import socket
import sys

import pytest

from helpers import (EARLIER, NO_NETWORK, assert_fails_clearly, launcher_env, run, script_command,
                     with_an_earlier_metrics_file)


def corrupt(name, how):
    """Damage one file of a copy of the test MNIST."""
    def damage(tmp_path):
        path = tmp_path / "data" / "MNIST" / "raw" / name
        content = path.read_bytes()
        path.write_bytes(content[: len(content) // 2] if how == "truncate" else b"\x00\x00\x00\x00" + content[4:])
    return damage


# Found later (by the launcher, setup, the data or the snapshot), or a bad flag as a user meets it:
# each started as a user starts it. id: (script, arguments, what the error line must say, how to prepare
# the data folder)
CASES = {
    "batch size 0": ("01_single_gpu.py", ["--batch-size", "0"], "argument --batch-size: must be in", None),
    "batch larger than the data": ("02_data_parallel.py", ["--batch-size", "100000"], "more than the", None),
    "batch not a whole number of microbatches": ("10_pipeline_parallel.py", ["--batch-size", "10"],
                                                 "--batch-size 10 is not a multiple of --microbatches", None),
    "gpu ids do not parse": ("02_data_parallel.py", ["--gpus", "a,b"], "--gpus a,b", None),
    "gpu id does not exist": ("02_data_parallel.py", ["--gpus", "99"], "--gpus 99", None),
    "data missing": ("01_single_gpu.py", [], "MNIST/raw/", "empty"),
    "truncated file": ("01_single_gpu.py", [], "cannot load MNIST", corrupt("t10k-images-idx3-ubyte", "truncate")),
    "corrupt file": ("01_single_gpu.py", [], "cannot load MNIST", corrupt("train-labels-idx1-ubyte", "magic")),
    "corrupt snapshot": ("06_fault_tolerant.py", ["--snapshot", "{tmp}/snapshot.pt"], "could not be loaded",
                         lambda tmp_path: (tmp_path / "snapshot.pt").write_bytes(b"not a snapshot")),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_bad_input_fails_with_one_clear_line(case, quick_mnist_dir, tmp_path):
    script, args, expected, prepare = CASES[case]
    data_dir = tmp_path / "data"
    if prepare != "empty":
        shutil.copytree(quick_mnist_dir, data_dir)
        if prepare:
            prepare(tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "runs.csv").write_text("mode,n\nsingle,1\n")  # an earlier harness run
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    args, metrics = with_an_earlier_metrics_file(args, tmp_path)
    # Started by hand as a launcher would start one process (torchrun adds its own report of a failure).
    result = run([sys.executable, script, "--data-dir", str(data_dir), "--max-steps", "2", *args], timeout=120,
                 env={**NO_NETWORK, **launcher_env()}, check=False)
    assert_fails_clearly(result, expected)
    assert metrics.read_text() == EARLIER
    assert all(p.read_bytes() == content for p, content in before.items()), "a file that was there changed"


def test_a_port_in_use_fails_with_one_clear_line(quick_mnist_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(script_command("04_ddp_spawn.py", "--data-dir", quick_mnist_dir, "--master-port", port,
                                    "--nprocs", 2), timeout=120, check=False)
    assert_fails_clearly(result, str(port))


def test_a_peer_that_never_arrives_fails_within_the_timeout(quick_mnist_dir):
    """Rank 0 of two, started by hand as a launcher would: rank 1 never comes."""
    result = run([sys.executable, "06_fault_tolerant.py", "--data-dir", str(quick_mnist_dir), "--timeout", "5"],
                 timeout=60, check=False, env=launcher_env(world_size=2))
    assert_fails_clearly(result, "could not join the others")


