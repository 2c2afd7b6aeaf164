"""scikit-learn's bundled handwritten digits (8×8, 1,797 images): the embedded default,
so the demo and tests run with no download. scikit-learn is imported when they are loaded: it
takes a second, which every Ray worker that imports the data package (an owner's CSV teachers
too) would otherwise pay at its start."""
from __future__ import annotations

import numpy as np

from conclave.learning.data.dataset import Dataset

TEST_SIZE = 500
_SPLIT_SEED = 0  # fixed: the train/test split is part of the dataset's definition


def load_digits() -> tuple[Dataset, Dataset]:
    """(train, test): 1,297 / 500 images [n, 1, 8, 8], pixel values 0..16 scaled to [0, 1]."""
    from sklearn import datasets

    bunch = datasets.load_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(y))
    train, test = np.sort(order[TEST_SIZE:]), np.sort(order[:TEST_SIZE])
    return (Dataset(x[train], y[train], 10, "digits/train"),
            Dataset(x[test], y[test], 10, "digits/test"))
