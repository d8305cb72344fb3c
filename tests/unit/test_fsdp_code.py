"""08_fsdp.py's code, in this process: it keeps every definition of 03 that sharding does not change, and refuses
bad input in one line as 03 does (08 run as a user runs it: tests/integration/test_fsdp.py)."""

import pytest
import torch

from helpers import FSDP_TEST_BATCH as TEST_BATCH, QUICK_TEST_IMAGES, definitions, launcher_env, load_script


def test_08_keeps_every_definition_of_03_that_sharding_does_not_change():
    """Flags and their checks, the device and the refusals, the data, the training step and the timing."""
    fsdp, ddp = definitions("08_fsdp.py"), definitions("03_ddp_launch.py")
    for name in ["Net", "in_range", "writable", "parse_args", "setup", "MNIST", "collate", "batches", "train_epoch",
                 "evaluate", "clock", "timed"]:
        assert fsdp[name] == ddp[name], f"08's {name} differs from 03's"


def refusal(script, argv=()):
    """What the script's setup() exits with, in this process (the test says what torch finds)."""
    module = load_script(script)
    with pytest.raises(SystemExit) as exited:
        module.setup(module.parse_args(list(argv)))
    return exited.value.code


def test_bad_input_is_refused_in_one_line_as_03_refuses_it(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    for key, value in {**launcher_env(world_size=2), "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    assert refusal("08_fsdp.py") == refusal("03_ddp_launch.py") == (
        "error: 2 processes on this machine but 1 GPU(s): start fewer, or add --cpu")
    assert refusal("08_fsdp.py", ["--lr", "nan"]).startswith("error: argument --lr: must be in")
    monkeypatch.delenv("RANK")  # started with python, not torchrun
    assert refusal("08_fsdp.py").startswith("error: start me with torchrun --standalone --nproc_per_node N")


class Numbered(torch.utils.data.Dataset):
    """A stand-in for 08's MNIST: each row's input is its own number, so a batch shows which rows it holds."""

    def __init__(self, args, train, device):
        self.rows = 4 * QUICK_TEST_IMAGES if train else QUICK_TEST_IMAGES

    def __len__(self):
        return self.rows

    def __getitems__(self, rows):
        return torch.tensor(rows).reshape(-1, 1), torch.zeros(len(rows), dtype=torch.long)


@pytest.mark.parametrize("n", [2, 3])
def test_every_rank_takes_as_many_evaluation_batches_as_rank_0(n, monkeypatch):
    """In-process, each rank's test batches at world size n with the tests' TEST_BATCH: a rank with one batch more
    than the others would wait in its extra forward's all-gather while they all-reduce, a hang (120 s)."""
    fsdp = load_script("08_fsdp.py")
    monkeypatch.setattr(fsdp, "MNIST", Numbered)
    args = fsdp.parse_args(["--test-batch-size", str(TEST_BATCH)])
    forwards, images, sizes = [], [], []
    for rank in range(n):
        _, testing = fsdp.load_data(args, rank, n, torch.device("cpu"))
        seen = [inputs[:, 0].tolist() for inputs, _ in testing()]
        forwards.append(len(seen))
        images += [i for batch in seen for i in batch]
        sizes += [len(batch) for batch in seen]
    assert len(set(forwards)) == 1, f"forwards per rank at world size {n}: {forwards}"
    assert sorted(images) == list(range(QUICK_TEST_IMAGES))  # every test image once
    assert max(sizes) <= TEST_BATCH, sizes


def saved_bytes(net, inputs):
    """The bytes one forward keeps for backward, each storage counted once, the weights left out."""
    weights = {p.untyped_storage().data_ptr() for p in net.parameters()}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(inputs).sum().backward()
    return sum(kept.values())


def test_12s_checkpointed_forward_keeps_only_its_input_and_recomputes_the_same_gradients():
    """--checkpoint-activations: 12 wraps its Net in checkpoint(), so a forward keeps the batch alone and backward
    runs the forward again. At B = 64, dropout off, the activations kept fall from 22,286,336 bytes (measured) to the
    input's 200,704; the gradients are the same, bit for bit (12 run at 2 ranks: tests/integration/test_fsdp_big.py)."""
    big = load_script("12_fsdp_big.py")
    inputs = torch.randn(64, 1, 28, 28)
    torch.manual_seed(0)
    plain, checkpointed = big.Net(dropout=False), big.Net(dropout=False)
    checkpointed.load_state_dict(plain.state_dict())
    big.checkpoint(checkpointed)
    assert saved_bytes(plain, inputs) > 100 * inputs.nbytes  # each layer's output, pooling's indices, ...
    assert saved_bytes(checkpointed, inputs) == inputs.nbytes == 200_704
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), checkpointed.parameters()))
