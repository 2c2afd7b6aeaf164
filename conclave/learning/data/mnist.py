"""MNIST from its four canonical IDX files (gzip-compressed or raw) in any directory.

IDX layout (LeCun et al.): a 4-byte magic number — two zero bytes, a type code (0x08 =
unsigned byte) and the number of dimensions — then each dimension as a big-endian uint32,
then the values. Images are idx3 (count, rows, cols), labels idx1 (count).
"""
from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

from conclave.learning.data.dataset import DataFormatError, Dataset

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_UBYTE = 0x08


def find_file(root: Path, name: str) -> Path:
    """``root/name`` or ``root/name.gz``, preferring the raw file when both exist."""
    for candidate in (root / name, root / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"MNIST file {name} (or {name}.gz) not found in {root}")


def read_idx(path: str | Path, ndim: int) -> np.ndarray:
    """The uint8 array stored in an IDX file with ``ndim`` dimensions; every header field
    and the exact byte length are checked, so a truncated or foreign file is an error."""
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as err:
        raise DataFormatError(f"{path}: cannot read ({err})") from err
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataFormatError(f"{path}: {len(raw)} bytes, too short for an IDX header")
    if raw[0] != 0 or raw[1] != 0 or raw[2] != _UBYTE or raw[3] != ndim:
        raise DataFormatError(f"{path}: bad IDX magic number 0x{raw[:4].hex()}, expected "
                              f"0x0000{_UBYTE:02x}{ndim:02x} (unsigned bytes, {ndim} dimensions)")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = header + int(np.prod(dims))
    if len(raw) != expected:
        raise DataFormatError(f"{path}: header promises dimensions {dims} ({expected} bytes) "
                              f"but the file holds {len(raw)} bytes")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _load_part(root: Path, part: str) -> Dataset:
    image_path, label_path = (find_file(root, name) for name in FILES[part])
    images = read_idx(image_path, ndim=3)
    labels = read_idx(label_path, ndim=1)
    if len(images) != len(labels):
        raise DataFormatError(f"{image_path} holds {len(images)} images but {label_path} "
                              f"holds {len(labels)} labels")
    if len(labels) and labels.max() > 9:
        raise DataFormatError(f"{label_path}: label {labels.max()} is not a digit 0..9")
    x = (images.astype(np.float32) / 255.0)[:, None, :, :]
    return Dataset(x, labels.astype(np.int64), 10, f"mnist/{part}")


def load_mnist(root: str | Path) -> tuple[Dataset, Dataset]:
    """(train, test) from the four IDX files in ``root``: images [n, 1, 28, 28] in [0, 1]."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"MNIST directory {root} does not exist")
    return _load_part(root, "train"), _load_part(root, "test")
