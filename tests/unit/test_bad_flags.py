"""Bad flags, each in this process: one clear line on stderr, a non-zero exit, no traceback, and nothing already
written is damaged (bad input found later, by the launcher, setup, the data or a snapshot, as a user meets it:
tests/integration/test_bad_input.py)."""
from types import SimpleNamespace

import pytest

from helpers import EARLIER, ROOT, assert_fails_clearly, error_lines, load_script, with_an_earlier_metrics_file


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
    "microbatches 0": ("10_pipeline_parallel.py", ["--microbatches", "0"], "argument --microbatches: must be in"),
    "schedule unknown": ("10_pipeline_parallel.py", ["--schedule", "zb"], "argument --schedule: invalid choice"),
}


def parsed_in_process(script, args, capsys):
    """The exit of script's parse_args(args) in this process, as a subprocess would show it: sys.exit(text)
    prints its text to stderr and exits 1 when the interpreter ends, which here it does not."""
    with pytest.raises(SystemExit) as exited:
        load_script(script).parse_args(args)
    code = exited.value.code
    message = f"{code}\n" if isinstance(code, str) else ""
    return SimpleNamespace(returncode=1 if message else code, stderr=capsys.readouterr().err + message)


@pytest.mark.parametrize("case", FLAGS, ids=list(FLAGS))
def test_a_bad_flag_is_refused_with_one_clear_line_before_any_work(case, tmp_path, capsys):
    script, args, expected = FLAGS[case]
    args, metrics = with_an_earlier_metrics_file(args, tmp_path)
    assert_fails_clearly(parsed_in_process(script, args, capsys), expected)
    assert metrics.read_text() == EARLIER and sorted(tmp_path.iterdir()) == [metrics]


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
    for script in sorted(p.name for p in ROOT.glob("[0-9][0-9]_*.py")):
        for flag in OUTPUT_FLAGS + (["--snapshot"] if script.startswith("06") else []):
            assert_fails_clearly(parsed_in_process(script, [flag, path], capsys), "cannot write")
    assert sorted(tmp_path.iterdir()) == [blocker] and blocker.read_text() == "kept"


def test_the_refusals_of_ranks_that_wrote_at_once_count_one_each():
    """sys.exit writes its message, then the newline: two ranks refusing at once can share a line (seen in CI)."""
    stderr = "error: not 3error: not 3\n\nerror: not 3\n[rank0]: E1203 torchrun's report\n"
    assert error_lines(stderr) == ["error: not 3"] * 3
