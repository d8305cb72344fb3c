"""09_tensor_parallel.py's code, in this process: what it keeps of 08 (09 run as a user runs it:
tests/integration/test_tensor_parallel.py), and how the tests meet torch's abort at a DTensor script's exit."""
import sys

import pytest

from helpers import definitions


def test_09_keeps_08s_definitions_except_where_every_rank_shares_the_batch():
    """Flags, device and refusals, the data, the training step and the clock are 08's (those every script shares
    word for word: tests/unit/test_docs.py)."""
    tensor_parallel, fsdp = definitions("09_tensor_parallel.py"), definitions("08_fsdp.py")
    for name in ["Net", "in_range", "writable", "parse_args", "MNIST", "collate", "batches", "load_data",
                 "train_epoch", "clock"]:  # setup(): 09's world has no rank, which no step of 09 reads
        assert tensor_parallel[name] == fsdp[name], f"09's {name} differs from 08's"


@pytest.mark.parametrize("last", ["passes", "aborts again", "fails otherwise"])
def test_a_run_that_torch_aborts_at_exit_runs_again_at_most_twice(last, tmp_path):
    """helpers.run reruns a checked run that ended in torch's exit abort (helpers.EXIT_ABORT), AGAIN (2) times at
    most: a third abort, or any other failure, still fails the test."""
    from helpers import AGAIN, EXIT_ABORT, run
    count = tmp_path / "runs"
    last_run = {"passes": "sys.exit(0)", "aborts again": f"sys.stderr.write({EXIT_ABORT!r}); sys.exit(1)",
                "fails otherwise": "sys.exit(3)"}[last]
    code = (f"import sys\nwith open({str(count)!r}, 'a') as f:\n    f.write('.')\n"
            f"if len(open({str(count)!r}).read()) <= {AGAIN}:\n    sys.stderr.write({EXIT_ABORT!r}); sys.exit(1)\n"
            f"{last_run}\n")
    with pytest.warns(UserWarning, match="aborted a worker at exit"):
        if last == "passes":
            assert run([sys.executable, "-c", code], timeout=30).returncode == 0
        else:
            with pytest.raises(AssertionError):
                run([sys.executable, "-c", code], timeout=30)
    assert count.read_text() == "." * (AGAIN + 1), "not run again, or run more often than AGAIN times"
