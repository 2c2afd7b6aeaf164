"""The in-memory dataset type, the private/public/test split, and disjoint teacher shards.

Every source reader returns ``Dataset`` objects in one layout — inputs as float32
``[n, *input_shape]``: images ``[n, C, H, W]`` scaled to [0, 1], table rows ``[n, d]`` of
finite numbers — and labels as int64 ``[n]`` (``UNLABELED`` = -1 throughout for a public pool
without labels), so models and training code never need to know where the data came from.
A dataset in a fixed feature representation (``learning.data.features``) keeps the layout and
names its ``features``; its values need only be finite.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

import numpy as np

from conclave.errors import ConclaveError, InvalidValue


UNLABELED = -1  # the label of every example of a pool that has none


class DataFormatError(ConclaveError, ValueError):
    """A data file exists but does not hold what its format promises (names the file)."""


@dataclass(frozen=True, eq=False)  # eq=False: numpy arrays have no single truth value
class Dataset:
    x: np.ndarray  # float32 [n, C, H, W]: images scaled to [0, 1], or features; [n, d]: table rows
    y: np.ndarray  # int64 [n], values in [0, num_classes), or all UNLABELED
    num_classes: int
    name: str
    features: str | None = None  # the representation of x; None: images

    def __post_init__(self) -> None:
        if not isinstance(self.x, np.ndarray) or self.x.dtype != np.float32 or self.x.ndim not in (2, 4):
            raise InvalidValue(f"{self.name}: x must be a float32 array [n, C, H, W] or [n, d], got "
                             f"{getattr(self.x, 'dtype', type(self.x))} {getattr(self.x, 'shape', '')}")
        if not isinstance(self.y, np.ndarray) or self.y.dtype != np.int64 or self.y.ndim != 1:
            raise InvalidValue(f"{self.name}: y must be an int64 array [n], got "
                             f"{getattr(self.y, 'dtype', type(self.y))} {getattr(self.y, 'shape', '')}")
        # NaN fails both comparisons, so this also rejects non-finite pixels
        if self.is_image and self.x.size and not (self.x.min() >= 0.0 and self.x.max() <= 1.0):
            raise InvalidValue(f"{self.name}: pixel values must be finite and in [0, 1], "
                             f"got [{self.x.min()}, {self.x.max()}]")
        if not self.is_image and not np.isfinite(self.x).all():
            raise InvalidValue(f"{self.name}: {f'{self.features} features' if self.features else 'table values'} "
                             "must be finite")
        if len(self.x) != len(self.y):
            raise InvalidValue(f"{self.name}: {len(self.x)} images but {len(self.y)} labels")
        if self.num_classes < 1:
            raise InvalidValue(f"{self.name}: num_classes must be positive, got {self.num_classes}")
        if len(self.y) and not self.unlabeled and (self.y.min() < 0 or self.y.max() >= self.num_classes):
            raise InvalidValue(f"{self.name}: labels must lie in [0, {self.num_classes}) (or all be "
                             f"UNLABELED), got [{self.y.min()}, {self.y.max()}]")

    def __len__(self) -> int:
        return len(self.y)

    def __repr__(self) -> str:  # the arrays themselves would flood logs and error messages
        features = "" if self.features is None else f", features={self.features!r}"
        return (f"Dataset(name={self.name!r}, n={len(self)}, input_shape={self.input_shape}, "
                f"num_classes={self.num_classes}{features})")

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example: (C, H, W) for images and features, (d,) for table rows."""
        return tuple(self.x.shape[1:])

    @property
    def is_image(self) -> bool:
        """Pixels in [0, 1] (not a table, not a feature representation)."""
        return self.features is None and self.x.ndim == 4

    @property
    def unlabeled(self) -> bool:
        """A pool without labels: every label is ``UNLABELED``."""
        return bool(len(self.y)) and bool((self.y == UNLABELED).all())

    def subset(self, indices: np.ndarray | list[int], name: str | None = None) -> Dataset:
        """The examples at ``indices`` (copied, in that order)."""
        indices = np.asarray(indices, dtype=np.int64)
        return Dataset(self.x[indices], self.y[indices], self.num_classes, name or self.name, self.features)


@dataclass(frozen=True, eq=False)
class Splits:
    """PATE's three roles: teachers' private data, the student's unlabeled pool, held-out test."""

    private: Dataset
    public: Dataset
    test: Dataset

    def student_side(self) -> StudentSplits:
        """The public pool and test split alone: what a driver may keep while the private
        split is read only by the actors that train on it."""
        return StudentSplits(public=self.public, test=self.test)


@dataclass(frozen=True, eq=False)
class StudentSplits:
    """The student's share of ``Splits``: its unlabeled pool and the held-out test set."""

    public: Dataset
    test: Dataset


def split_datasets(train: Dataset, test: Dataset, *, public_size: int, seed: int,
                   private_size: int | None = None) -> Splits:
    """PATE convention: private = ``train`` (optionally a seeded subsample of
    ``private_size``); public = the first ``public_size`` of a seeded shuffle of ``test``;
    test = the rest of ``test``. Same inputs and seed → same splits.
    """
    if not 0 < public_size < len(test):
        raise InvalidValue(f"public_size must be in [1, {len(test) - 1}] so that the test split "
                         f"is not empty ({test.name} has {len(test)} examples), got {public_size}")
    if private_size is not None and not 0 < private_size <= len(train):
        raise InvalidValue(f"private_size must be in [1, {len(train)}] ({train.name} has "
                         f"{len(train)} examples), got {private_size}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(test))
    private = train
    if private_size is not None and private_size < len(train):
        # Sorted so a subsample keeps the source order; which examples is the seed's choice.
        private = train.subset(np.sort(rng.choice(len(train), private_size, replace=False)))
    return Splits(
        private=replace(private, name=f"{train.name}/private"),
        public=test.subset(order[:public_size], f"{test.name}/public"),
        test=test.subset(order[public_size:], f"{test.name}/test"),
    )


SHARD_LEMMA = ("a record's shard is a keyed hash of the record alone (learning.data.shard), so adding or "
               "removing one record changes one shard: one teacher's training set, hence at most one vote")


def record_hashes(dataset: Dataset, key: int) -> np.ndarray:
    """uint64 per record: a BLAKE2b hash, keyed with ``key``, of the record's own bytes (input and label)."""
    key_bytes = int(key).to_bytes(16, "little", signed=True)
    rows = np.ascontiguousarray(dataset.x).reshape(len(dataset), math.prod(dataset.input_shape))  # -1: not for n = 0
    labels = dataset.y.astype("<i8")
    return np.array([int.from_bytes(hashlib.blake2b(row.tobytes() + label.tobytes(), digest_size=8,
                                                     key=key_bytes).digest(), "little")
                     for row, label in zip(rows, labels)], dtype=np.uint64)


def shard(dataset: Dataset, num_shards: int, seed: int) -> list[Dataset]:
    """Split ``dataset`` into ``num_shards`` disjoint shards that cover it.

    A record's shard is a keyed hash of the record itself (``record_hashes`` with key
    ``seed``), not of its position: adding or removing one record changes exactly one shard,
    so a teacher ensemble's one-vote analysis holds for add/remove neighbours (a shuffle of
    positions would reshuffle every shard). Shard sizes are therefore equal only on
    average (multinomial), and a shard may be empty (fewer records than shards is not an error:
    whether it happens depends on the records); records keep their source order within a shard.
    """
    if num_shards < 1:
        raise InvalidValue(f"num_shards must be >= 1, got {num_shards}")
    assignment = record_hashes(dataset, seed) % np.uint64(num_shards)
    return [dataset.subset(np.flatnonzero(assignment == i), f"{dataset.name}/shard{i}") for i in range(num_shards)]


def shard_cap(declared_records: int, num_shards: int) -> int:
    """The most records one shard keeps when the owner declared ``declared_records``: its share
    plus three standard deviations of a hashed shard's size, so an owner holding what it declared
    loses almost nothing (a shard of a multinomial split passes it with probability ≈ 0.1%)."""
    share = declared_records / num_shards
    return math.ceil(share + 3 * math.sqrt(share))


def cap_shard(part: Dataset, cap: int, rng: np.random.Generator) -> Dataset:
    """``part`` itself, or a uniformly random ``cap`` of its records (in source order).

    Cutting each shard on its own keeps the shard lemma: adding or removing one record changes
    only its own shard's selection. Cutting the whole data to a fixed size would not (a new
    record would push out one of another shard: two teachers changed)."""
    if len(part) <= cap:
        return part
    return part.subset(np.sort(rng.choice(len(part), size=cap, replace=False)), part.name)
