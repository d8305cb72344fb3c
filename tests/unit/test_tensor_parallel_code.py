"""09_tensor_parallel.py's code, in this process: what it keeps of 08 (09 run as a user runs it:
tests/integration/test_tensor_parallel.py)."""
from helpers import definitions


def test_09_keeps_08s_definitions_except_where_every_rank_shares_the_batch():
    """Flags, device and refusals, the data, the training step and the clock are 08's (those every script shares
    word for word: tests/unit/test_docs.py)."""
    tensor_parallel, fsdp = definitions("09_tensor_parallel.py"), definitions("08_fsdp.py")
    for name in ["Net", "in_range", "writable", "parse_args", "MNIST", "collate", "batches", "load_data",
                 "train_epoch", "clock"]:  # setup(): 09's world has no rank, which no step of 09 reads
        assert tensor_parallel[name] == fsdp[name], f"09's {name} differs from 08's"
