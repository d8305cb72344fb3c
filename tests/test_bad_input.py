"""Bad input: one clear line on stderr, a non-zero exit, no traceback, and nothing already written is damaged
(the data, an existing snapshot, metrics file or results folder are byte-identical afterwards)."""
import shutil
import socket

import pytest

from conftest import NO_NETWORK, free_port, run, script_command


def corrupt(name, how):
    """Damage one file of a copy of the test MNIST."""
    def damage(tmp_path):
        path = tmp_path / "data" / "MNIST" / "raw" / name
        content = path.read_bytes()
        path.write_bytes(content[: len(content) // 2] if how == "truncate" else b"\x00\x00\x00\x00" + content[4:])
    return damage


# id: (script, arguments, what the error line must mention, how to prepare the data folder)
CASES = {
    "batch size 0": ("01_single_gpu.py", ["--batch-size", "0"], "--batch-size must be positive", None),
    "epochs 0": ("03_ddp_launch.py", ["--epochs", "0"], "--epochs must be positive", None),
    "nprocs 0": ("04_ddp_spawn.py", ["--nprocs", "0"], "--nprocs must be positive", None),
    "gpus per node 0": ("05_multinode_mnist.py", ["-g", "0"], "must be positive", None),
    "gpu ids do not parse": ("02_data_parallel.py", ["--gpus", "a,b"], "not a comma-separated list", None),
    "gpu id does not exist": ("02_data_parallel.py", ["--gpus", "99"], "--gpus 99", None),
    "node rank outside": ("05_multinode_mnist.py", ["-n", "2", "--nr", "2", "--master-port", "29999"],
                          "outside 0..1", None),
    "multi-node without port": ("05_multinode_mnist.py", ["-n", "2", "--nr", "1"], "same port", None),
    "port not a port": ("04_ddp_spawn.py", ["--master-port", "70000"], "not a port number", None),
    "data missing": ("01_single_gpu.py", [], "--synthetic", "empty"),
    "truncated file": ("01_single_gpu.py", [], "could not be loaded", corrupt("t10k-images-idx3-ubyte", "truncate")),
    "corrupt file": ("01_single_gpu.py", [], "could not be loaded", corrupt("train-labels-idx1-ubyte", "magic")),
    "metrics folder missing": ("01_single_gpu.py", ["--metrics-json", "{tmp}/missing/m.json"], "cannot write", None),
    "metrics path is a folder": ("04_ddp_spawn.py", ["--metrics-json", "{tmp}"], "cannot write", None),
    "corrupt snapshot": ("03_ddp_launch.py", ["--snapshot", "{tmp}/snapshot.pt"], "snapshot",
                         lambda tmp_path: (tmp_path / "snapshot.pt").write_bytes(b"not a snapshot")),
    "negative snapshot interval": ("05_multinode_mnist.py", ["--snapshot-every", "-1"], "must not be negative", None),
}


def assert_fails_clearly(result, expected):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr


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
    metrics = tmp_path / "metrics.json"
    metrics.write_text('{"earlier": "run"}')
    args = [a.format(tmp=tmp_path) for a in args]
    if "--metrics-json" not in args:
        args += ["--metrics-json", str(metrics)]
    result = run(script_command(script, "--data-dir", data_dir, "--max-steps", 2, *args), timeout=120,
                 env=NO_NETWORK, check=False)
    assert_fails_clearly(result, expected)
    assert metrics.read_text() == '{"earlier": "run"}'
    assert all(p.read_bytes() == content for p, content in before.items()), "a file that was there changed"


def test_a_port_in_use_fails_with_one_clear_line(quick_mnist_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(script_command("04_ddp_spawn.py", "--data-dir", quick_mnist_dir, "--master-port", port, "--nprocs", 2,
                                    "--timeout", 30), timeout=120, check=False)
    assert_fails_clearly(result, f":{port}")


def test_a_peer_that_never_arrives_fails_within_the_timeout(quick_mnist_dir):
    result = run(script_command("05_multinode_mnist.py", "--data-dir", quick_mnist_dir, "-n", 2, "--nr", 0,
                                "--master-port", free_port(), "--timeout", 5), timeout=60, check=False)
    assert_fails_clearly(result, "could not join the process group")
