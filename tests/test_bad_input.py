"""Bad input: one clear line on stderr, a non-zero exit, no traceback, and nothing already written is damaged
(the data, an existing snapshot, metrics file or results folder are byte-identical afterwards)."""
import shutil
import socket
import sys
from types import SimpleNamespace

import pytest

from conftest import NO_NETWORK, ROOT, launcher_env, load_script, run, script_command


def corrupt(name, how):
    """Damage one file of a copy of the test MNIST."""
    def damage(tmp_path):
        path = tmp_path / "data" / "MNIST" / "raw" / name
        content = path.read_bytes()
        path.write_bytes(content[: len(content) // 2] if how == "truncate" else b"\x00\x00\x00\x00" + content[4:])
    return damage


# Refused when the flags are parsed, before any work: each checked in this process (a subprocess per case
# would spend most of its seconds importing torch). id: (script, arguments, what the error line must say)
FLAGS = {
    "learning rate not a number": ("01_single_gpu.py", ["--lr", "nan"], "argument --lr: must be in"),
    "learning rate infinite": ("03_ddp_launch.py", ["--lr", "inf"], "argument --lr: must be in"),
    "learning rate negative": ("02_data_parallel.py", ["--lr", "-1"], "argument --lr: must be in"),
    "seed negative": ("01_single_gpu.py", ["--seed", "-1"], "argument --seed: must be in"),
    "seed too large": ("04_ddp_spawn.py", ["--seed", str(2**32)], "argument --seed: must be in"),
    "epochs 0": ("03_ddp_launch.py", ["--epochs", "0"], "argument --epochs: must be in"),
    "epochs not a number": ("01_single_gpu.py", ["--epochs", "two"], "argument --epochs: invalid"),
    "test batch size negative": ("05_multinode_mnist.py", ["--test-batch-size", "-5"], "--test-batch-size"),
    "max steps negative": ("02_data_parallel.py", ["--max-steps", "-1"], "argument --max-steps: must be in"),
    "log interval negative": ("06_fault_tolerant.py", ["--log-interval", "-1"], "argument --log-interval"),
    "threads negative": ("05_multinode_mnist.py", ["--threads", "-2"], "argument --threads: must be in"),
    "nprocs 0": ("04_ddp_spawn.py", ["--nprocs", "0"], "argument --nprocs"),
    "nodes 0": ("05_multinode_mnist.py", ["-n", "0"], "--nodes"),
    "gpus per node 0": ("05_multinode_mnist.py", ["-g", "0"], "--gpus"),
    "node rank outside": ("05_multinode_mnist.py", ["-n", "2", "--nr", "2"], "outside 0..1"),
    "port not a port": ("04_ddp_spawn.py", ["--master-port", "70000"], "argument --master-port"),
    "master address that does not resolve": ("05_multinode_mnist.py", ["--master-addr", "no-such-host.invalid"],
                                             "--master-addr no-such-host.invalid"),  # not a wait of minutes
    "negative snapshot interval": ("06_fault_tolerant.py", ["--snapshot-every", "-1"], "--snapshot-every"),
    "timeout 0": ("06_fault_tolerant.py", ["--timeout", "0"], "--timeout"),
    "timeout not a number": ("06_fault_tolerant.py", ["--timeout", "nan"], "--timeout"),
}

# Found later (by the launcher, setup, the data or the snapshot), or one of the above as a user meets it:
# each started as a user starts it. id: (script, arguments, what the error line must say, how to prepare
# the data folder)
CASES = {
    "batch size 0": ("01_single_gpu.py", ["--batch-size", "0"], "argument --batch-size: must be in", None),
    "batch larger than the data": ("02_data_parallel.py", ["--batch-size", "100000"], "more than the", None),
    "gpu ids do not parse": ("02_data_parallel.py", ["--gpus", "a,b"], "--gpus a,b", None),
    "gpu id does not exist": ("02_data_parallel.py", ["--gpus", "99"], "--gpus 99", None),
    "data missing": ("01_single_gpu.py", [], "--synthetic", "empty"),
    "truncated file": ("01_single_gpu.py", [], "could not be loaded", corrupt("t10k-images-idx3-ubyte", "truncate")),
    "corrupt file": ("01_single_gpu.py", [], "could not be loaded", corrupt("train-labels-idx1-ubyte", "magic")),
    "corrupt snapshot": ("06_fault_tolerant.py", ["--snapshot", "{tmp}/snapshot.pt"], "could not be loaded",
                         lambda tmp_path: (tmp_path / "snapshot.pt").write_bytes(b"not a snapshot")),
}


def assert_fails_clearly(result, expected):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr


def parsed_in_process(script, args, capsys):
    """The exit of script's parse_args(args) in this process, as a subprocess would show it: sys.exit(text)
    prints its text to stderr and exits 1 when the interpreter ends, which here it does not."""
    with pytest.raises(SystemExit) as exited:
        load_script(script).parse_args(args)
    code = exited.value.code
    message = f"{code}\n" if isinstance(code, str) else ""
    return SimpleNamespace(returncode=1 if message else code, stderr=capsys.readouterr().err + message)


EARLIER = '{"earlier": "run"}'


def with_an_earlier_metrics_file(args, tmp_path):
    """(the case's arguments with {tmp} filled in, and --metrics-json unless it names one, that file):
    the file holds an earlier run's record, which a refused run must leave as it was."""
    metrics = tmp_path / "metrics.json"
    metrics.write_text(EARLIER)
    args = [a.format(tmp=tmp_path) for a in args]
    return (args if "--metrics-json" in args else [*args, "--metrics-json", str(metrics)]), metrics


@pytest.mark.parametrize("case", FLAGS, ids=list(FLAGS))
def test_a_bad_flag_is_refused_with_one_clear_line_before_any_work(case, tmp_path, capsys):
    script, args, expected = FLAGS[case]
    args, metrics = with_an_earlier_metrics_file(args, tmp_path)
    assert_fails_clearly(parsed_in_process(script, args, capsys), expected)
    assert metrics.read_text() == EARLIER and sorted(tmp_path.iterdir()) == [metrics]


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


# Output paths that cannot be written, each tried (not guessed from the folder's mode bits): {blocker} is a file.
BAD_OUTPUTS = {"folder missing": "{tmp}/missing/out", "a folder": "{tmp}", "folder is a file": "{blocker}/out",
               "folder no one may write in, root too": "/proc/out"}
OUTPUT_FLAGS = ["--metrics-json", "--save-model"]


@pytest.mark.parametrize("bad", BAD_OUTPUTS, ids=list(BAD_OUTPUTS))
def test_every_script_tries_its_output_paths_before_any_work(bad, tmp_path, capsys):
    """The class, not the case: every output flag of every numbered script (07 too, 06's --snapshot) refuses a
    path it could not write, at parse time, and leaves nothing behind."""
    blocker = tmp_path / "a-file"
    blocker.write_text("kept")
    path = BAD_OUTPUTS[bad].format(tmp=tmp_path, blocker=blocker)
    for script in sorted(p.name for p in ROOT.glob("0[0-9]_*.py")):
        for flag in OUTPUT_FLAGS + (["--snapshot"] if script.startswith("06") else []):
            assert_fails_clearly(parsed_in_process(script, [flag, path], capsys), "cannot write")
    assert sorted(tmp_path.iterdir()) == [blocker] and blocker.read_text() == "kept"
