"""A data source named in a config — a file in some format, or a benchmark — read into a ``Dataset``.

    source = DataSource(format="csv", path="/data/a/records.csv", label="diagnosis")
    dataset = source.read(classes=("benign", "malignant"))

Each format is one reader in its own module, registered in ``FORMATS`` as "module:function"
(imported on first use, so reading a CSV never imports PIL). A reader returns ``RawData``:
float32 inputs and the raw label values (strings or numbers, or None); ``DataSource.read``
maps labels onto the run's class list, which comes from the config or from the public test
data — never from an owner's records, so every owner's teachers share one label space and an
owner's class set is not published by the ensemble's shape.

The reading happens wherever ``read`` is called: for an owner's data that is inside the
owner's actors, on the owner's node. Nothing here opens a file at construction.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from learning.data.dataset import UNLABELED, DataFormatError, Dataset

FORMATS: dict[str, str] = {
    "csv": "learning.data.tables:read_csv",
    "parquet": "learning.data.tables:read_parquet",
    "npz": "learning.data.arrays:read_npz",
    "npy": "learning.data.arrays:read_npy",
    "images": "learning.data.image_folder:read_image_folder",
    # the benchmarks, so the papers' experiments can be owners' data too
    "digits": "learning.data.benchmark:read_benchmark",
    "mnist": "learning.data.benchmark:read_benchmark",
    "cifar10": "learning.data.benchmark:read_benchmark",
    "cifar100": "learning.data.benchmark:read_benchmark",
    "svhn": "learning.data.benchmark:read_benchmark",
}


@dataclass(frozen=True, eq=False)
class RawData:
    """What a reader found: inputs ``float32 [n, C, H, W]`` (pixels in [0, 1]) or ``[n, d]``,
    and the label of each row as stored (None: the source has no labels)."""

    x: np.ndarray
    labels: np.ndarray | None


@dataclass(frozen=True)
class DataSource:
    """Where one data set lives and how to read it.

    ``format``: one of ``FORMATS``. ``path``: the file or folder (not needed for ``digits``);
    for a benchmark, the folder of its files. ``label``: the label column (csv, parquet), the
    labels' array key (npz) or labels file (npy); None for an unlabeled pool. ``columns``: the
    input columns of a table (default: every column but the label). ``inputs``: the npz key of
    the inputs. ``channels``: 1 (grayscale) or 3 (RGB) for an image folder. ``split``: which
    part of a benchmark (train or test).
    """

    format: str
    path: str | None = None
    label: str | None = None
    columns: tuple[str, ...] | None = None
    inputs: str = "x"
    channels: int = 1
    split: str = "train"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown data format {self.format!r}; choose one of {', '.join(FORMATS)}")
        if self.path is None and self.format != "digits":
            raise ValueError(f"data format {self.format!r} needs a path")
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels}")
        if self.split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {self.split!r}")

    def anchored(self, base: str) -> DataSource:
        """The same source with relative paths taken from ``base`` (a string operation: no
        file is touched, so the driver can anchor an owner's path without opening it)."""
        def anchor(path: str | None) -> str | None:
            return path if path is None or os.path.isabs(path) else os.path.normpath(os.path.join(base, path))

        label = anchor(self.label) if self.format == "npy" and self.label else self.label
        return replace(self, path=anchor(self.path), label=label)

    @property
    def describes(self) -> str:
        return f"{self.format} {self.path}" if self.path else self.format

    def read_raw(self) -> RawData:
        module_name, function_name = FORMATS[self.format].split(":")
        reader = getattr(importlib.import_module(module_name), function_name)
        if self.path is not None and not Path(self.path).exists():
            raise FileNotFoundError(f"{self.path}: no such file or folder")
        raw = reader(self)
        if raw.x.dtype != np.float32 or raw.x.ndim not in (2, 4) or not len(raw.x):
            raise DataFormatError(f"{self.describes}: read {raw.x.dtype} {raw.x.shape}; expected a non-empty "
                                  "float32 [n, d] table or [n, C, H, W] images")
        if raw.labels is not None and len(raw.labels) != len(raw.x):
            raise DataFormatError(f"{self.describes}: {len(raw.x)} inputs but {len(raw.labels)} labels")
        return raw

    def read(self, classes: tuple[str, ...], name: str | None = None) -> Dataset:
        """The source as a ``Dataset`` whose labels index ``classes`` (all ``UNLABELED`` when it
        has none); a label outside ``classes`` is an error naming it."""
        raw = self.read_raw()
        y = np.full(len(raw.x), UNLABELED, dtype=np.int64) if raw.labels is None else label_indices(
            raw.labels, classes, self.describes)
        return Dataset(raw.x, y, len(classes), name or self.describes)


def label_names(labels: np.ndarray) -> list[str]:
    """Each label as the string a class list names it by (integers without a decimal point)."""
    values = labels.tolist()
    return [str(int(v)) if isinstance(v, float) and v.is_integer() else str(v) for v in values]


def class_names(labels: np.ndarray) -> tuple[str, ...]:
    """The distinct labels of public data, in numeric order when all are integers."""
    names = sorted(set(label_names(labels)))
    try:
        return tuple(sorted(names, key=int))
    except ValueError:
        return tuple(names)


def label_indices(labels: np.ndarray, classes: tuple[str, ...], where: str) -> np.ndarray:
    index = {name: i for i, name in enumerate(classes)}
    names = label_names(labels)
    unknown = sorted({n for n in names if n not in index})
    if unknown:
        shown = ", ".join(repr(u) for u in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise DataFormatError(f"{where}: label(s) {shown} not among the classes {list(classes)}")
    return np.fromiter((index[n] for n in names), dtype=np.int64, count=len(names))
