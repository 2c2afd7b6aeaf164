"""SVHN cropped digits (Netzer et al. 2011) from ``train_32x32.mat`` and ``test_32x32.mat``.

Each MATLAB file holds ``X``, uint8 [32, 32, 3, n] (height, width, channel, example), and
``y``, [n, 1] with values 1..10 where 10 stands for the digit 0.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from conclave.learning.data.dataset import DataFormatError, Dataset

FILES = {"train": "train_32x32.mat", "test": "test_32x32.mat"}


def _load_part(root: Path, part: str) -> Dataset:
    path = root / FILES[part]
    if not path.is_file():
        raise FileNotFoundError(f"SVHN file {FILES[part]} not found in {root}")
    import scipy.io  # here, not at the top: every actor imports this module, few read SVHN

    try:
        mat = scipy.io.loadmat(path)
    except Exception as err:  # scipy raises several types on a damaged file
        raise DataFormatError(f"{path}: not a readable MATLAB file ({err})") from err
    if "X" not in mat or "y" not in mat:
        raise DataFormatError(f"{path}: expected variables X and y")
    images, labels = mat["X"], np.asarray(mat["y"]).reshape(-1)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[:3] != (32, 32, 3):
        raise DataFormatError(f"{path}: X must be uint8 [32, 32, 3, n], got {images.dtype} {images.shape}")
    if len(labels) != images.shape[3]:
        raise DataFormatError(f"{path}: {images.shape[3]} images but {len(labels)} labels")
    if len(labels) and (labels.min() < 1 or labels.max() > 10):
        raise DataFormatError(f"{path}: labels must lie in 1..10, got [{labels.min()}, {labels.max()}]")
    x = images.transpose(3, 2, 0, 1).astype(np.float32) / 255.0
    y = (labels.astype(np.int64) % 10)  # 10 means the digit 0
    return Dataset(np.ascontiguousarray(x), y, 10, f"svhn/{part}")


def load_svhn(root: str | Path) -> tuple[Dataset, Dataset]:
    """(train, test) images [n, 3, 32, 32] in [0, 1], labels 0..9."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"SVHN directory {root} does not exist")
    return _load_part(root, "train"), _load_part(root, "test")
