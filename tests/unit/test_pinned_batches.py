"""Pinned batches, the DataLoader's CUDA-only path, run on the CPU. Pinned memory is page-locked host memory: the GPU
copies from it directly, so a copy with non_blocking=True lets the CPU go on. The numbered scripts keep MNIST on the
device, where pinning is wrong (CUDA refuses: "cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be
pinned"); a copier's Dataset that reads files gives host tensors, which are pinned on CUDA (docs/copying.md). Here
torch answers as on a machine with one CUDA GPU (the stand-in of tests/stand_in_accelerator), so the DataLoader
takes its pinning path, and Tensor.pin_memory, which needs the GPU, records what it is given."""
import pytest
import torch
import torchvision  # noqa: F401  (it imports torch._dynamo, which reads what the stand-in replaces: first)

from helpers import SCRIPTS, load_script, stand_in_accelerator

COPIES = ["docs/copying/text_classifier.py", "docs/copying/text_classifier_06.py"]  # files, 2 workers
CPU = torch.device("cpu")


@pytest.fixture
def pinned_on_cuda(monkeypatch):
    """The tensors the DataLoader pins, on a stand-in machine with one CUDA GPU."""
    pinned = []

    def pin(tensor, *args, **kwargs):
        pinned.append(tensor)
        return tensor
    stand_in_accelerator.play(monkeypatch.setattr, "cuda", 1, used=lambda name, query=False: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    return pinned


@pytest.mark.parametrize("script", SCRIPTS)
def test_data_kept_on_the_device_is_never_pinned(script, quick_mnist_dir, pinned_on_cuda):
    module = load_script(script)
    args = module.parse_args(["--data-dir", str(quick_mnist_dir)])
    loader = module.batches(module.MNIST(args, True, CPU), list(range(64)), 32, args.seed)
    inputs, labels = next(iter(loader))
    assert pinned_on_cuda == [], f"{script} pins the batches of a Dataset that lives on the GPU"


def copy_loader(copy, folder, rows=12, batch_size=4):
    """The worked copy's training loader, as its load_data makes it, over `rows` rows of train.csv in folder."""
    module = load_script(copy)
    (folder / "train.csv").write_text("".join(f"{i % 4},{' '.join(map(str, range(1, 2 + i % 5)))}\n"
                                              for i in range(rows)))
    args = module.parse_args(["--data-dir", str(folder)])
    return module.batches(module.CSVText(args, True, CPU), list(range(rows)), batch_size, args.seed)


@pytest.mark.parametrize("copy", COPIES)
def test_a_copiers_batches_from_files_are_pinned_on_cuda(copy, tmp_path, pinned_on_cuda):
    batches = list(copy_loader(copy, tmp_path, rows=12, batch_size=4))  # its 2 workers, then the pinning thread
    assert len(batches) == 3
    for batch in batches:
        assert all(any(tensor is pinned for pinned in pinned_on_cuda) for tensor in batch), f"{copy}: not pinned"


@pytest.mark.parametrize("copy", COPIES)
def test_a_copiers_batches_are_not_pinned_without_cuda(copy, tmp_path, recwarn):
    """On the CPU (or a Mac) pinning is of no use, and the DataLoader warns: the copies do not ask for it."""
    loader = copy_loader(copy, tmp_path)
    assert loader.pin_memory is False
    next(iter(loader))
    assert not [w for w in recwarn if "pin_memory" in str(w.message)]
