"""Data sources (digits, MNIST, CIFAR-10/100, SVHN), PATE splits and teacher shards.

    train, test = load_dataset("mnist", "/data/mnist")
    splits = make_splits("digits", public_size=250, seed=0)
    teachers = shard(splits.private, num_shards=10, seed=0)
"""
from __future__ import annotations

from pathlib import Path

from conclave.errors import InvalidValue
from conclave.learning.data.cifar import load_cifar
from conclave.learning.data.dataset import DataFormatError, Dataset, Splits, StudentSplits, shard, split_datasets
from conclave.learning.data.digits import load_digits
from conclave.learning.data.mnist import load_mnist, read_idx
from conclave.learning.data.svhn import load_svhn

DATASET_NAMES = ("digits", "mnist", "cifar10", "cifar100", "svhn")


def load_dataset(name: str, root: str | Path | None = None) -> tuple[Dataset, Dataset]:
    """(train, test) of dataset ``name``; every source but the bundled digits needs ``root``."""
    if name == "digits":
        return load_digits()
    if name not in DATASET_NAMES:
        raise InvalidValue(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    if root is None:
        raise InvalidValue(f"dataset {name!r} is read from files: give the directory that holds them")
    if name == "mnist":
        return load_mnist(root)
    if name == "svhn":
        return load_svhn(root)
    return load_cifar(root, num_classes=int(name.removeprefix("cifar")))


def make_splits(name: str, root: str | Path | None = None, *, public_size: int, seed: int,
                private_size: int | None = None) -> Splits:
    """Load ``name`` and split it the PATE way (see ``split_datasets``); deterministic in ``seed``."""
    train, test = load_dataset(name, root)
    return split_datasets(train, test, public_size=public_size, seed=seed, private_size=private_size)


__all__ = [
    "DATASET_NAMES", "DataFormatError", "Dataset", "Splits", "StudentSplits", "load_cifar", "load_dataset",
    "load_digits", "load_mnist", "load_svhn", "make_splits", "read_idx", "shard", "split_datasets",
]
