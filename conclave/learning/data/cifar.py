"""CIFAR-10 and CIFAR-100 from the "python version" pickle batches (Krizhevsky 2009).

CIFAR-10 (folder ``cifar-10-batches-py``): ``data_batch_1`` … ``data_batch_5`` and
``test_batch``, each a dict with ``b'data'`` (uint8 [n, 3072]: 1,024 red, then green, then
blue values, rows top to bottom) and ``b'labels'``. CIFAR-100 (folder ``cifar-100-python``):
``train`` and ``test`` with ``b'data'`` and ``b'fine_labels'`` (100 classes).

Pickle can run arbitrary code, so batches are read with an unpickler that only
rebuilds plain containers and numpy arrays.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np

from conclave.errors import InvalidValue
from conclave.learning.data.dataset import DataFormatError, Dataset

LAYOUT = {
    10: ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], b"labels"),
    100: ("cifar-100-python", ["train"], ["test"], b"fine_labels"),
}
_IMAGE_BYTES = 3 * 32 * 32

# What numpy needs to rebuild an array from a pickle (protocol 2 as in the published files,
# or protocol 5 as numpy 2 writes), plus the bytes constructor Python 3 uses at protocol 2;
# anything else in a batch file is refused.
_ALLOWED_GLOBALS = {
    ("_codecs", "encode"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
}


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def _read_batch(path: Path, label_key: bytes, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise FileNotFoundError(f"CIFAR-{num_classes} batch {path} not found")
    try:
        batch = _ArrayUnpickler(io.BytesIO(path.read_bytes()), encoding="bytes").load()
    except Exception as err:  # pickle raises many types on garbage; all mean "corrupt"
        raise DataFormatError(f"{path}: not a readable CIFAR pickle ({err})") from err
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise DataFormatError(f"{path}: expected a dict with b'data' and {label_key!r}, got {keys}")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[label_key])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _IMAGE_BYTES:
        raise DataFormatError(f"{path}: b'data' must be uint8 [n, {_IMAGE_BYTES}], "
                              f"got {data.dtype} {data.shape}")
    if labels.shape != (len(data),) or not np.issubdtype(labels.dtype, np.integer):
        raise DataFormatError(f"{path}: {label_key!r} must hold {len(data)} integer labels, "
                              f"got {labels.dtype} {labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataFormatError(f"{path}: labels outside [0, {num_classes})")
    return data, labels.astype(np.int64)


def _resolve_root(root: Path, folder: str) -> Path:
    """Accept the dataset folder itself or the directory that contains it."""
    if (root / folder).is_dir():
        return root / folder
    if root.is_dir():
        return root
    raise FileNotFoundError(f"CIFAR directory {root} does not exist")


def _load_part(directory: Path, names: list[str], label_key: bytes, num_classes: int,
               part: str) -> Dataset:
    batches = [_read_batch(directory / name, label_key, num_classes) for name in names]
    data = np.concatenate([b[0] for b in batches])
    x = data.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0
    return Dataset(x, np.concatenate([b[1] for b in batches]), num_classes,
                   f"cifar{num_classes}/{part}")


def load_cifar(root: str | Path, num_classes: int = 10) -> tuple[Dataset, Dataset]:
    """(train, test) images [n, 3, 32, 32] in [0, 1]; ``num_classes`` is 10 or 100."""
    if num_classes not in LAYOUT:
        raise InvalidValue(f"CIFAR comes with 10 or 100 classes, not {num_classes}")
    folder, train_names, test_names, label_key = LAYOUT[num_classes]
    directory = _resolve_root(Path(root), folder)
    return (_load_part(directory, train_names, label_key, num_classes, "train"),
            _load_part(directory, test_names, label_key, num_classes, "test"))
