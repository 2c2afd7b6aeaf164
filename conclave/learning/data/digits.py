"""scikit-learn's bundled handwritten digits (8×8, 1,797 images): the embedded default,
so the demo and tests run with no download. The file is read where scikit-learn installed it,
without importing scikit-learn: that import (with SciPy) took 1.3 s of CPU, which every Ray
worker that loads the digits (each teacher actor on them) paid at its start."""
from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import numpy as np

from conclave.learning.data.dataset import Dataset

TEST_SIZE = 500
_SPLIT_SEED = 0  # fixed: the train/test split is part of the dataset's definition


def _bundled_file() -> Path:
    """scikit-learn's ``datasets/data/digits.csv.gz`` (what ``sklearn.datasets.load_digits`` reads):
    found through the package's location, which looking it up does not import."""
    spec = find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the digits data set is scikit-learn's: install scikit-learn")
    return Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"


def load_digits() -> tuple[Dataset, Dataset]:
    """(train, test): 1,297 / 500 images [n, 1, 8, 8], pixel values 0..16 scaled to [0, 1]."""
    rows = np.loadtxt(_bundled_file(), delimiter=",")  # 64 pixels and the label, per image
    x = (rows[:, :-1].reshape(-1, 8, 8).astype(np.float32) / 16.0)[:, None, :, :]
    y = rows[:, -1].astype(np.int64)
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(y))
    train, test = np.sort(order[TEST_SIZE:]), np.sort(order[:TEST_SIZE])
    return (Dataset(x[train], y[train], 10, "digits/train"),
            Dataset(x[test], y[test], 10, "digits/test"))
