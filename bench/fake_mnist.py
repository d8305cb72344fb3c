"""MNIST's raw files, and a learnable stand-in in their format (the scripts' loading code runs) for tests."""
import os
import struct

MNIST_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


def missing_mnist_files(data_dir):
    return [f for f in MNIST_FILES if not os.path.exists(os.path.join(data_dir, "MNIST", "raw", f))]


def write_fake_mnist(root, train=60000, test=10000):
    """MNIST/raw/ under root; returns root. Each class: a fixed random pattern plus noise (learnable, not trivially)."""
    import torch  # here, not at the top: the harness reads MNIST_FILES and must start without torch
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    prototypes = (torch.rand(10, 28, 28, generator=torch.Generator().manual_seed(0)) > 0.8).float()
    generator = torch.Generator().manual_seed(1)
    for split, n in (("train", train), ("t10k", test)):
        labels = torch.randint(0, 10, (n,), generator=generator)
        images = 160 * prototypes[labels] + 95 * torch.rand(n, 28, 28, generator=generator)
        for kind, array, magic in (("images-idx3", images, 2051), ("labels-idx1", labels, 2049)):
            with open(os.path.join(raw, f"{split}-{kind}-ubyte"), "wb") as f:
                f.write(struct.pack(f">{1 + array.dim()}I", magic, *array.shape))
                f.write(array.to(torch.uint8).numpy().tobytes())
    return root
