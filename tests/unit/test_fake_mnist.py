"""The tests' own MNIST (bench/fake_mnist.py): the sizes asked for, in torchvision's raw layout, so that the scripts'
real loading code reads it."""
import torch
from torchvision import datasets

from helpers import write_fake_mnist


def test_fake_mnist_has_the_requested_sizes_in_torchvisions_layout(tmp_path):
    write_fake_mnist(tmp_path, train=300, test=200)
    train, test = datasets.MNIST(tmp_path, train=True), datasets.MNIST(tmp_path, train=False)
    assert (len(train), len(test)) == (300, 200)
    assert train.data.dtype == torch.uint8 and set(train.targets.tolist()) <= set(range(10))
