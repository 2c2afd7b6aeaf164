"""What a query must look like, and how table inputs are scaled — both from public data only.

``InputSchema`` is the contract the aggregator checks every request against (shape, and the
value range where the inputs have one: images in [0, 1]); teachers, student and outside
clients share it. For tables it also names the columns, in order: the public pool's, by which
every table of a run is read (``learning.data.sources.DataSource.by_name``). ``Standardiser``
centres and scales table columns with statistics of the *public* pool (or given in the
config): computing them from an owner's records would be a release of private data without a
mechanism. Its optional ``keep`` mask drops columns (a DP screening run's choice: post-processing
of a DP release, ``cluster.active_gateways``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from conclave.errors import InvalidValue
from conclave.learning.data.dataset import Dataset


@dataclass(frozen=True)
class InputSchema:
    """One example's shape and, where the inputs have one, its value range (inclusive); for a
    table read from named columns, their names in the inputs' order."""

    shape: tuple[int, ...]
    kind: str = "image"  # image | table | features
    low: float | None = 0.0
    high: float | None = 1.0
    columns: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.shape or any(int(d) < 1 for d in self.shape):
            raise InvalidValue(f"input shape must be non-empty and positive, got {self.shape}")
        if self.columns is not None and (self.kind != "table" or tuple(self.shape) != (len(self.columns),)):
            raise InvalidValue(f"{len(self.columns)} column names do not fit {self.kind} inputs of shape {self.shape}")

    @classmethod
    def of(cls, dataset: Dataset, columns: tuple[str, ...] | None = None) -> InputSchema:
        """The schema ``dataset``'s inputs follow (queries are what the student's pool holds);
        ``columns``: a table's column names, as read."""
        shape = tuple(int(d) for d in dataset.input_shape)
        if dataset.is_image:
            return cls(shape, "image", 0.0, 1.0)
        if dataset.features is not None:
            return cls(shape, "features", None, None)
        return cls(shape, "table", None, None, columns)

    @classmethod
    def for_shape(cls, shape: tuple[int, ...]) -> InputSchema:
        """The schema queries of this shape follow by default: rows [d] are table inputs,
        anything else images in [0, 1] (teachers on features still take images)."""
        shape = tuple(int(d) for d in shape)
        return cls(shape, "table", None, None) if len(shape) == 1 else cls(shape, "image", 0.0, 1.0)

    @property
    def image_size(self) -> tuple[int, int] | None:
        """The images' (height, width), at which an owner's image folder is read; None for
        inputs that are not images."""
        return (self.shape[-2], self.shape[-1]) if self.kind == "image" and len(self.shape) == 3 else None

    def describe(self) -> str:
        bounds = "" if self.low is None else f", values in [{self.low:g}, {self.high:g}]"
        names = "" if self.columns is None else f", columns {', '.join(self.columns)}"
        return f"{self.kind} inputs of shape [batch, {', '.join(map(str, self.shape))}] float32{bounds}{names}"


@dataclass(frozen=True, eq=False)
class Standardiser:
    """Per-column ``(x - mean) / scale`` for table models; statistics of public data only.
    ``keep``: which columns the model reads (a dropped one reads as exactly 0); None: every one."""

    mean: np.ndarray  # float32 [d]
    scale: np.ndarray  # float32 [d], > 0
    keep: np.ndarray | None = None  # bool [d], at least one True

    @classmethod
    def of_public(cls, public: Dataset) -> Standardiser:
        """Column statistics of the public pool (a constant column gets scale 1)."""
        if public.x.ndim != 2:
            raise InvalidValue(f"a standardiser is for table rows [n, d], got {public.x.shape}")
        mean = public.x.mean(axis=0, dtype=np.float64)
        scale = public.x.std(axis=0, dtype=np.float64)
        return cls(mean.astype(np.float32), np.where(scale > 0, scale, 1.0).astype(np.float32))

    def __post_init__(self) -> None:
        if self.mean.shape != self.scale.shape or self.mean.ndim != 1 or not (self.scale > 0).all():
            raise InvalidValue("standardiser: mean and scale must be [d] arrays with scale > 0")
        if self.keep is not None and (self.keep.dtype != np.bool_ or self.keep.shape != self.mean.shape
                                      or not self.keep.any()):
            raise InvalidValue("standardiser: keep must be one bool per column, at least one True")

    def keeping(self, keep: np.ndarray) -> Standardiser:
        """These statistics reading only the columns ``keep`` (bool [d])."""
        return Standardiser(self.mean, self.scale, np.asarray(keep, dtype=bool))
