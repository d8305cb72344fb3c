"""MNIST's raw files as torchvision lays them out, and a learnable stand-in for machines that cannot download it.

It has MNIST's shape and file format, so the scripts' real loading code runs; it is no benchmark of
accuracy (one epoch on it reaches 100%). Used by tests/conftest.py and bench/classic_vs_ours.py.
"""
import os
import struct

MNIST_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


def missing_mnist_files(data_dir):
    """The raw files torchvision needs that are not under data_dir/MNIST/raw (what --data-dir points to)."""
    raw = os.path.join(data_dir, "MNIST", "raw")
    return [f for f in MNIST_FILES if not os.path.exists(os.path.join(raw, f))]


def write_idx(path, array, magic):
    with open(path, "wb") as f:
        f.write(struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape))
        f.write(array.numpy().tobytes())


def learnable_images(n, generator):
    """Each class is a fixed random stroke pattern plus noise: learnable in a few dozen steps, not trivially."""
    import torch  # here, not at the top: the harness reads MNIST_FILES and must start without torch
    prototypes = (torch.rand(10, 28, 28, generator=torch.Generator().manual_seed(0)) > 0.8).float()
    labels = torch.randint(0, 10, (n,), generator=generator)
    images = 160 * prototypes[labels] + 95 * torch.rand(n, 28, 28, generator=generator)
    return images.to(torch.uint8), labels.to(torch.uint8)


def write_fake_mnist(root, train=60000, test=10000):
    """MNIST/raw/ under root: train and test images with their labels. Returns root."""
    import torch
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    for split, n in (("train", train), ("t10k", test)):
        images, labels = learnable_images(n, g)
        write_idx(os.path.join(raw, f"{split}-images-idx3-ubyte"), images, 2051)
        write_idx(os.path.join(raw, f"{split}-labels-idx1-ubyte"), labels, 2049)
    return root
