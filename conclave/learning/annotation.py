"""Who labels the public points a strategy picked.

The public pool is kept without labels; an ``Annotator`` is the only way to get one, and it
counts what it was asked (what a real labelling service would bill). The default,
``RevealingAnnotator``, stands in for a human annotator: it holds the pool's true labels and
reveals only those bought. ``CallableAnnotator`` turns any labelling function into an
annotator — e.g. the teacher ensemble's aggregator client, whose privacy cost lands in the
aggregator's own ledger.
"""
from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from conclave.errors import InvalidValue
from conclave.learning.data import Dataset

UNLABELED = -1


class Annotator(Protocol):
    bought: int  # labels requested so far

    def label(self, indices: np.ndarray) -> np.ndarray:
        """int64 labels for public points ``indices`` (``UNLABELED`` = -1 where none is given)."""
        ...


def _check_indices(indices: np.ndarray, size: int) -> np.ndarray:
    indices = np.asarray(indices)
    if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer):
        raise InvalidValue("indices must be a 1-D integer array")
    if len(indices) and (indices.min() < 0 or indices.max() >= size):
        raise InvalidValue(f"indices must be in [0, {size}) (the public pool)")
    return indices


class RevealingAnnotator:
    """Reveals the true labels of the chosen points only."""

    def __init__(self, labels: np.ndarray) -> None:
        self._labels = np.asarray(labels, dtype=np.int64)
        self.bought = 0

    def label(self, indices: np.ndarray) -> np.ndarray:
        indices = _check_indices(indices, len(self._labels))
        self.bought += len(indices)
        return self._labels[indices].copy()


class CallableAnnotator:
    """Labels from ``label_fn(inputs) -> int64 labels`` applied to the chosen public inputs."""

    def __init__(self, inputs: np.ndarray, label_fn: Callable[[np.ndarray], np.ndarray]) -> None:
        self._inputs = inputs
        self._label_fn = label_fn
        self.bought = 0

    def label(self, indices: np.ndarray) -> np.ndarray:
        indices = _check_indices(indices, len(self._inputs))
        self.bought += len(indices)
        labels = np.asarray(self._label_fn(self._inputs[indices]), dtype=np.int64)
        if labels.shape != indices.shape:
            raise InvalidValue(f"annotator returned {labels.shape} labels for {indices.shape} points")
        return labels


def hide_labels(pool: Dataset) -> tuple[np.ndarray, RevealingAnnotator]:
    """Split a labelled public pool into its inputs (what strategies see) and the annotator."""
    return pool.x, RevealingAnnotator(pool.y)


def split_private_public(train: Dataset, private_size: int, seed: int) -> tuple[Dataset, Dataset]:
    """Active-learning split of one training set: a seeded ``private_size`` subset is the
    private data, the disjoint rest is the public pool (whose labels only an annotator reveals)."""
    if not 0 < private_size < len(train):
        raise InvalidValue(f"private_size must be in [1, {len(train) - 1}] so that the public pool "
                         f"is not empty ({train.name} has {len(train)} examples), got {private_size}")
    order = np.random.default_rng(seed).permutation(len(train))
    return (train.subset(np.sort(order[:private_size]), f"{train.name}/private"),
            train.subset(order[private_size:], f"{train.name}/public"))
