"""A data source named in a config — a file in some format, or a benchmark — read into a ``Dataset``.

Each format is one reader, registered in ``FORMATS`` and imported on first use. ``read`` is for
public data: an unusable row is an error. ``read_private`` is for an owner's data on its node: an
unusable row is dropped there and reported to the owner alone (``RowCheck``), since an error
would make the run depend on one record. Labels map onto the run's public class list; tables
are read by column name, images at the public pool's size.
"""
from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from conclave.errors import InvalidValue
from conclave.learning.data.dataset import UNLABELED, DataFormatError, Dataset
from conclave.registry import Registry, imported

FORMATS: Registry[Callable[[DataSource], RawData]] = Registry("data format", {
    "csv": "conclave.learning.data.tables:read_csv",
    "parquet": "conclave.learning.data.tables:read_parquet",
    "npz": "conclave.learning.data.arrays:read_npz",
    "npy": "conclave.learning.data.arrays:read_npy",
    "images": "conclave.learning.data.image_folder:read_image_folder",
    # the benchmarks, so the papers' experiments can be owners' data too
    "digits": "conclave.learning.data.benchmark:read_benchmark",
    "mnist": "conclave.learning.data.benchmark:read_benchmark",
    "cifar10": "conclave.learning.data.benchmark:read_benchmark",
    "cifar100": "conclave.learning.data.benchmark:read_benchmark",
    "svhn": "conclave.learning.data.benchmark:read_benchmark",
})
TABLE_FORMATS = ("csv", "parquet")
# How a table's input columns are read from its header alone (imported by path, as the readers).
TABLE_HEADER = "conclave.learning.data.tables:table_input_columns"
# An image folder's size from its first image (imported by path, as the readers).
IMAGE_SIZE = "conclave.learning.data.image_folder:folder_image_size"
# Formats whose labels come with the data itself (an image folder's class folders, a benchmark's
# files), so they need no ``label``.
LABELLED_BY_LAYOUT = ("images", "digits", "mnist", "cifar10", "cifar100", "svhn")


class MissingColumns(DataFormatError):
    """A table lacks columns it is read by (``missing``): the label, or input columns that the
    run's schema (the public pool's header) names, so the caller can say which file sets them."""

    def __init__(self, message: str, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True, eq=False)
class RawData:
    """What a reader found: inputs ``float32 [n, C, H, W]`` (pixels in [0, 1]) or ``[n, d]``,
    and the label of each row as stored (None: the source has no labels).

    ``unusable``: rows the reader found unusable (a missing, non-numeric or infinite value, a
    line that is no record, an unreadable image), row number → why; whatever their ``x`` rows
    hold is dropped with them."""

    x: np.ndarray
    labels: np.ndarray | None
    unusable: dict[int, str] = field(default_factory=dict)
    filled: dict[int, str] = field(default_factory=dict)  # rows kept with cells filled (``DataSource.fill``) → which


@dataclass(frozen=True)
class RowCheck:
    """What reading one source found wrong, row by row (row numbers from 0, in file order).
    For an owner's data this stays on the owner's node: only ``conclave check-data`` prints it."""

    source: str
    rows: int  # rows read
    problems: dict[int, str]  # row → why it was dropped
    filled: dict[int, str] = field(default_factory=dict)  # row → the cells filled from public values (kept)

    @property
    def kept(self) -> int:
        return self.rows - len(self.problems)

    def reasons(self) -> Counter:
        return Counter(self.problems.values())

    def summary(self, limit: int = 3) -> str:
        """The problems by reason, with the first rows of each, in one line."""
        rows_of: dict[str, list[int]] = {}
        for row, why in sorted(self.problems.items()):
            rows_of.setdefault(why, []).append(row)
        parts = [f"{why} (row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows[:3]))}"
                 f"{f' and {len(rows) - 3} more' if len(rows) > 3 else ''})" for why, rows in rows_of.items()]
        return "; ".join(parts[:limit]) + (f"; and {len(parts) - limit} other problems" if len(parts) > limit else "")


@dataclass(frozen=True)
class PublicReading:
    """How a run reads every owner's data, set by its public data alone (never by an owner's):
    a table by the pool's input ``columns``, with the pool's column means (``fill``) in a cell
    that cannot be used; an image folder at the pool's image ``size``."""

    columns: tuple[str, ...] | None = None
    size: tuple[int, int] | None = None
    fill: tuple[float, ...] | None = None


@dataclass(frozen=True)
class DataSource:
    """Where one data set lives and how to read it.

    ``format``: one of ``FORMATS``. ``path``: the file or folder (not needed for ``digits``);
    for a benchmark, the folder of its files. ``label``: the label column (csv, parquet), the
    labels' array key (npz) or labels file (npy); None for an unlabeled pool; an image folder's
    labels are its class folders' names and a benchmark's its own. ``columns``: the input columns
    of a table, read by name in this order (default: every column but the label, in file order;
    a run sets them to the public pool's, ``by_name``). ``inputs``: the npz key of
    the inputs. ``channels``: 1 (grayscale) or 3 (RGB) for an image folder. ``split``: which
    part of a benchmark (train or test). ``size``: an image folder's (height, width); an image
    of another size is an unusable row. An owner's folder is read at the public pool's
    (``sized``), so it is usually left out. ``fill``: for a table, one public value per input
    column that takes the place of a cell that is missing, not a number or not finite (a run
    gives an owner's table the public pool's column means, ``read_as``); a row is then unusable
    only when none of its cells is.
    """

    format: str
    path: str | None = None
    label: str | None = None
    columns: tuple[str, ...] | None = None
    inputs: str = "x"
    channels: int = 1
    split: str = "train"
    size: tuple[int, int] | None = None
    fill: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        FORMATS.path(self.format)  # an unknown format: ``UnknownName``, a ValueError naming the known ones
        if self.path is None and self.format != "digits":
            raise InvalidValue(f"data format {self.format!r} needs a path")
        if self.channels not in (1, 3):
            raise InvalidValue(f"channels must be 1 or 3, got {self.channels}")
        if self.split not in ("train", "test"):
            raise InvalidValue(f"split must be 'train' or 'test', got {self.split!r}")
        if self.size is not None and (len(self.size) != 2 or min(self.size) < 1):
            raise InvalidValue(f"size is an image's [height, width], got {list(self.size)}")
        if self.fill is not None and (self.format not in TABLE_FORMATS or not all(map(math.isfinite, self.fill))):
            raise InvalidValue("fill is a table's finite public value per input column")

    def anchored(self, base: str) -> DataSource:
        """The same source with relative paths taken from ``base`` (a string operation: no
        file is touched, so the driver can anchor an owner's path without opening it)."""
        def anchor(path: str | None) -> str | None:
            return path if path is None or os.path.isabs(path) else os.path.normpath(os.path.join(base, path))

        label = anchor(self.label) if self.format == "npy" and self.label else self.label
        return replace(self, path=anchor(self.path), label=label)

    def by_name(self, columns: tuple[str, ...] | None) -> DataSource:
        """This source reading exactly ``columns`` by name, in that order (the public schema's;
        None, or a source that is not a table: the source as it is). An explicit ``columns``
        must name the same ones. A string operation: no file is touched."""
        if columns is None or self.format not in TABLE_FORMATS:
            return self
        if self.columns is not None and set(self.columns) != set(columns):
            raise InvalidValue(f"columns {list(self.columns)} are not the public pool's {list(columns)}: "
                             "leave columns out (inputs are read by name) or list the same ones")
        return replace(self, columns=tuple(columns))

    def read_as(self, reading: PublicReading) -> DataSource:
        """This source read as the run's public data says (``PublicReading``): a table by the
        pool's columns with the pool's means in unusable cells, an image folder at the pool's size.
        A string operation: no file is touched."""
        source = self.by_name(reading.columns).sized(reading.size)
        if reading.fill is None or source.format not in TABLE_FORMATS:
            return source
        return replace(source, fill=tuple(float(value) for value in reading.fill))

    def sized(self, size: tuple[int, int] | None) -> DataSource:
        """This image folder read at ``size`` (the public pool's; None, or a source that is not an
        image folder: the source as it is). A declared ``size`` must be the same. A string
        operation: no file is touched."""
        if size is None or self.format != "images":
            return self
        size = (int(size[0]), int(size[1]))
        if self.size is not None and tuple(self.size) != size:
            raise InvalidValue(f"size {list(self.size)} is not the public pool's {list(size)}: leave size out "
                             "(an owner's images are read at the pool's) or give the same one")
        return replace(self, size=size)

    @property
    def labelled_by_layout(self) -> bool:
        """Whether the labels come with the data (class folders, a benchmark), not from ``label``."""
        return self.format in LABELLED_BY_LAYOUT

    @property
    def describes(self) -> str:
        return f"{self.format} {self.path}" if self.path else self.format

    def read_raw(self) -> RawData:
        reader = FORMATS.load(self.format)
        _check_exists(self)
        raw = reader(self)
        if raw.x.dtype != np.float32 or raw.x.ndim not in (2, 4):
            raise DataFormatError(f"{self.describes}: read {raw.x.dtype} {raw.x.shape}; expected a "
                                  "float32 [n, d] table or [n, C, H, W] images")
        if raw.labels is not None and len(raw.labels) != len(raw.x):
            raise DataFormatError(f"{self.describes}: {len(raw.x)} inputs but {len(raw.labels)} labels")
        return raw

    def read(self, classes: tuple[str, ...], name: str | None = None) -> Dataset:
        """Public data as a ``Dataset`` whose labels index ``classes`` (all ``UNLABELED`` when it
        has none). Every row must be usable: an empty source, an unusable value or a label outside
        ``classes`` is an error naming the rows."""
        dataset, check = _read(self, classes, name)
        if not check.rows:
            raise DataFormatError(f"{self.describes}: no records")
        if check.problems:
            raise DataFormatError(f"{self.describes}: {check.summary()}")
        return dataset

    def read_private(self, classes: tuple[str, ...], name: str | None = None) -> tuple[Dataset, RowCheck]:
        """An owner's data on its node: the usable rows as a ``Dataset``, and what was dropped
        (see the module docstring: never an error, never shown outside the owner's node). An
        image folder needs its ``size``: taken from its own images, one image could decide
        which others are dropped."""
        if self.format == "images" and self.size is None:
            raise DataFormatError(f"{self.describes}: an owner's image folder is read at a given size "
                                  "(the public pool's, or its own size: [height, width])")
        return _read(self, classes, name)


# What public data says about how a run reads every owner's (``PublicReading``), read from its files.


def image_size(source: DataSource) -> tuple[int, int] | None:
    """The size (height, width) of ``source``'s public images: an image folder's declared ``size``
    or its first image's (public images must all be of one size), an array's or a benchmark's
    images' as read; None for tables."""
    if source.format in TABLE_FORMATS:
        return None
    if source.size is not None:
        return (int(source.size[0]), int(source.size[1]))
    _check_exists(source)
    if source.format == "images":
        return imported(IMAGE_SIZE)(source)
    x = source.read_raw().x
    return (x.shape[-2], x.shape[-1]) if x.ndim == 4 else None


def input_columns(source: DataSource) -> tuple[str, ...] | None:
    """A table's input columns as read (``columns``, or every column but the label in file order),
    from its header alone; None for data that is not a table."""
    if source.format not in TABLE_FORMATS:
        return None
    _check_exists(source)
    return imported(TABLE_HEADER)(source)


def column_means(source: DataSource) -> tuple[float, ...] | None:
    """A table's mean per input column over its finite cells (the public pool's fill every
    table's missing cells in a run: ``cluster.owners.PublicData.read``); None for data that is
    not a table. A column without one finite cell is a ``DataFormatError``."""
    if source.format not in TABLE_FORMATS:
        return None
    x = replace(source, fill=None).read_raw().x.astype(np.float64)
    finite = np.isfinite(x)
    empty = [name for name, any_ in zip(input_columns(source) or (), finite.any(axis=0)) if not any_]
    if empty or not len(x):
        raise DataFormatError(f"{source.describes}: no usable value in column(s) {empty or 'any'}")
    return tuple(float(value) for value in np.where(finite, x, 0.0).sum(axis=0) / finite.sum(axis=0))


def _check_exists(source: DataSource) -> None:
    if source.path is not None and not Path(source.path).exists():
        raise FileNotFoundError(f"{source.path}: no such file or folder")


def _read(source: DataSource, classes: tuple[str, ...], name: str | None) -> tuple[Dataset, RowCheck]:
    """Every row of ``source`` that a ``Dataset`` takes, and what was wrong with the others."""
    raw = source.read_raw()
    problems = {**unfit_rows(raw.x), **raw.unusable}  # the reader's reason names more (a column)
    if raw.labels is None:
        y = np.full(len(raw.x), UNLABELED, dtype=np.int64)
    else:
        y, label_problems = label_indices(raw.labels, classes)
        problems = {**label_problems, **problems}  # an unusable input is the first thing to fix
    keep = np.ones(len(raw.x), dtype=bool)
    keep[list(problems)] = False
    dataset = Dataset(raw.x[keep], y[keep], len(classes), name or source.describes)
    filled = {row: why for row, why in raw.filled.items() if row not in problems}
    return dataset, RowCheck(source.describes, len(raw.x), problems, filled)


def unfit_rows(x: np.ndarray) -> dict[int, str]:
    """The rows of float32 inputs a ``Dataset`` would refuse (row → why): a NaN or an infinity,
    or in images ``[n, C, H, W]`` a pixel outside [0, 1]."""
    flat = x.reshape(len(x), int(np.prod(x.shape[1:])))  # -1 cannot size an empty source's rows
    finite = np.isfinite(flat).all(axis=1)
    unfit = {int(row): "NaN or infinite value" for row in np.flatnonzero(~finite)}
    if x.ndim == 4:  # NaN fails both comparisons, and those rows are named above
        inside = (flat.min(axis=1, initial=0.0) >= 0) & (flat.max(axis=1, initial=0.0) <= 1)
        unfit.update({int(row): "pixel outside [0, 1] (store uint8 images to have them scaled)"
                      for row in np.flatnonzero(finite & ~inside)})
    return unfit


def label_names(labels: np.ndarray) -> list[str]:
    """Each label as the string a class list names it by: a number by its value (integers without
    a decimal point), whether stored as a number or as text. Named one by one, so one record
    cannot change how the others are named (a CSV column of numbers becomes text when one label
    is not a number: ``1.0`` must still be class ``1``)."""
    return [_label_name(value) for value in labels.tolist()]


def _label_name(value: object) -> str:
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        # only what reads as a number in a numeric column (Python's float also takes "1_0", " 1")
        if not math.isfinite(number) or value != value.strip() or "_" in value:
            return value
        value = number
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def class_names(labels: np.ndarray) -> tuple[str, ...]:
    """The distinct labels of public data, in numeric order when all are integers."""
    names = sorted(set(label_names(labels)))
    try:
        return tuple(sorted(names, key=int))
    except ValueError:
        return tuple(names)


def label_indices(labels: np.ndarray, classes: tuple[str, ...]) -> tuple[np.ndarray, dict[int, str]]:
    """Each label's index in ``classes``, and the rows whose label is missing or not among
    them (row → why; their index is 0, for the caller to drop)."""
    index = {name: i for i, name in enumerate(classes)}
    missing = _missing(labels)
    names = label_names(labels)
    problems = {row: "missing label" if missing[row] else
                f"label {_shortened(names[row])!r} not among the classes {list(classes)}"
                for row in range(len(names)) if missing[row] or names[row] not in index}
    y = np.fromiter((index.get(n, 0) for n in names), dtype=np.int64, count=len(names))
    return y, problems


def _shortened(name: str, limit: int = 40) -> str:
    """A label as a one-line message shows it (one record's label may be a whole novel)."""
    return name if len(name) <= limit else name[:limit] + "…"


def _missing(labels: np.ndarray) -> np.ndarray:
    """Which labels are missing (NaN or None), for labels of any dtype."""
    if labels.dtype.kind == "f":
        return np.isnan(labels)
    if labels.dtype.kind == "O":
        return np.array([v is None or (isinstance(v, float) and v != v) for v in labels.tolist()], dtype=bool)
    return np.zeros(len(labels), dtype=bool)
