"""What the README tells a learner of PyTorch's own behaviour, checked in this process: a device string, the old
parser's --local-rank, the evaluation sampler, the loader's random state and its warnings, DataParallel's state
dict, the default timeouts (DDP itself on two processes, and the errors a user meets at the command line:
tests/integration/test_readme_claims.py)."""
import argparse
import multiprocessing
import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers import MODES, ROOT, load_script


def test_a_dataparallel_state_dict_has_module_prefixes_even_on_the_cpu():
    assert sorted(nn.DataParallel(nn.Linear(2, 2)).state_dict()) == ["module.bias", "module.weight"]


def test_a_device_string_with_a_space_is_invalid():
    with pytest.raises(RuntimeError, match=r"Invalid device string: 'cuda: 1'"):
        torch.device("cuda: 1")  # the post's spelling
    assert torch.device("cuda:1") == torch.device("cuda", 1)


def test_an_old_parser_takes_both_spellings_of_local_rank_with_one_more_option_string():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-rank", "--local_rank", type=int, default=-1)
    assert parser.parse_args(["--local-rank=3"]).local_rank == 3  # what the legacy launcher passes now
    assert parser.parse_args(["--local_rank=2"]).local_rank == 2  # what it passed before PyTorch 2.0
    assert not callable(getattr(multiprocessing, "spawn", None)) and callable(mp.spawn)  # the post's import


def test_an_evaluation_sampler_of_every_world_size_th_image_counts_each_once():
    test_set = TensorDataset(torch.arange(10))
    seen = [i for rank in range(3)
            for (batch,) in DataLoader(test_set, batch_size=4, sampler=range(rank, len(test_set), 3))
            for i in batch.tolist()]
    assert sorted(seen) == list(range(10))
    padded = [i for rank in range(3) for i in DistributedSampler(test_set, 3, rank, shuffle=False)]
    assert len(padded) == 12  # DistributedSampler repeats two images to even out the shards


def test_a_dataloader_draws_from_the_global_random_state_unless_given_a_generator():
    data = TensorDataset(torch.arange(8))
    torch.manual_seed(0)
    iter(DataLoader(data, shuffle=True))
    after_plain = torch.rand(1)
    torch.manual_seed(0)
    iter(DataLoader(data, shuffle=True, generator=torch.Generator().manual_seed(0)))
    after_own = torch.rand(1)
    torch.manual_seed(0)
    assert after_own == torch.rand(1) and after_plain != after_own  # the plain loader moved the global state


def test_the_data_loader_advice_warns_on_a_small_cpu_machine():
    data = TensorDataset(torch.arange(8.0))
    with pytest.warns(UserWarning, match="'pin_memory' argument is set as true but no accelerator is found"):
        next(iter(DataLoader(data, pin_memory=True)))
    too_many = (os.cpu_count() or 1) + 2
    with pytest.warns(UserWarning, match=f"will create {too_many} worker processes in total"):
        DataLoader(data, num_workers=too_many).check_worker_number_rationality()


def test_the_default_timeouts_are_30_minutes_and_10_with_nccl():
    from torch.distributed import constants
    assert constants.default_pg_timeout.total_seconds() == 30 * 60
    assert constants.default_pg_nccl_timeout.total_seconds() == 10 * 60


def spans(numbers):
    """["03", "04", "05", "06", "08"] as "03-06 and 08": the README's way of naming runs of scripts."""
    runs, out = [], []
    for number in numbers:
        if runs and int(number) == int(runs[-1][-1]) + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    out = [run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs]
    return ", ".join(out[:-1]) + " and " + out[-1] if len(out) > 1 else out[0]


def test_the_readme_names_the_scripts_that_set_their_device_and_01s_steps_as_the_code_has_them():
    """Read from the code, not from copies: who calls set_device_index, and how many full batches 01's epoch has."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    setting = [mode.number for mode in MODES.values() if "set_device_index" in (ROOT / mode.script).read_text()]
    assert f"; {spans(setting)} set each rank's device;" in readme, spans(setting)
    batch = load_script("01_single_gpu.py").parse_args([]).batch_size
    assert f"01's whole epoch is {60000 // batch}." in readme
