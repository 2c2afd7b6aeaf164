"""NumPy arrays: ``.npz`` archives (inputs and labels by key) and ``.npy`` files.

Inputs ``[n, d]`` are table rows; ``[n, H, W]`` or ``[n, C, H, W]`` are images, either uint8
(scaled by 1/255) or floats already in [0, 1]. Archives are loaded without pickles: an array
file must not be able to run code.
"""
from __future__ import annotations

import zipfile

import numpy as np

from conclave.learning.data.dataset import DataFormatError
from conclave.learning.data.sources import DataSource, RawData


def read_npz(source: DataSource) -> RawData:
    try:
        with np.load(source.path, allow_pickle=False) as archive:
            keys = list(archive.keys())
            if source.inputs not in keys or (source.label and source.label not in keys):
                wanted = [source.inputs] + ([source.label] if source.label else [])
                raise DataFormatError(f"{source.path}: needs arrays {wanted}; it holds {keys}")
            x = archive[source.inputs]
            labels = archive[source.label] if source.label else None
    except (zipfile.BadZipFile, ValueError, OSError) as err:
        if isinstance(err, DataFormatError):
            raise
        raise DataFormatError(f"{source.path}: not a readable .npz archive ({err})") from None
    return RawData(inputs(x, source.path), labels)


def read_npy(source: DataSource) -> RawData:
    """``path``: the inputs; ``label``: the path of a labels ``.npy`` (optional)."""
    x = _load_npy(source.path)
    labels = _load_npy(source.label) if source.label else None
    if labels is not None and labels.ndim != 1:
        raise DataFormatError(f"{source.label}: labels must be one-dimensional, got shape {labels.shape}")
    return RawData(inputs(x, source.path), labels)


def _load_npy(path: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError) as err:
        raise DataFormatError(f"{path}: not a readable .npy array ({err})") from None


def inputs(x: np.ndarray, path: str) -> np.ndarray:
    """float32 table rows or images from an array as stored (uint8 images scaled to [0, 1]).
    A row that is not usable as float32 (a NaN, an infinity, a float64 past float32's range, a
    pixel outside [0, 1]) is found where every source's rows are checked (``sources.unfit_rows``)."""
    if x.ndim == 3:
        x = x[:, None]  # [n, H, W] → one channel
    if x.ndim not in (2, 4) or not np.issubdtype(x.dtype, np.number):
        raise DataFormatError(f"{path}: expected numbers [n, d], [n, H, W] or [n, C, H, W], got {x.dtype} {x.shape}")
    if x.ndim == 4 and x.dtype == np.uint8:
        return (x.astype(np.float32) / 255.0).astype(np.float32)
    with np.errstate(over="ignore"):  # past float32's range: inf, a row the caller drops
        return x.astype(np.float32)
