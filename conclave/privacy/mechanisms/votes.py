"""Validation of the one input every vote mechanism takes: a batch of vote histograms."""
from __future__ import annotations

import numpy as np
from conclave.errors import InvalidValue


def check_votes(votes: np.ndarray) -> np.ndarray:
    """``votes`` as int64 [batch, k], or ValueError naming what is wrong with it."""
    array = np.asarray(votes)
    if array.ndim != 2:
        raise InvalidValue(f"votes must be 2-D [batch, classes], got shape {array.shape}")
    if array.shape[1] == 0:
        raise InvalidValue("votes must have at least one class column")
    if not np.issubdtype(array.dtype, np.integer):
        raise InvalidValue(f"votes must be integers, got dtype {array.dtype}")
    if np.any(array < 0):
        raise InvalidValue("votes must be non-negative counts")
    return array.astype(np.int64, copy=False)


def check_answered(answered: np.ndarray | None, queries: int) -> np.ndarray:
    """The boolean mask [queries] of released answers (all, when None), or ValueError."""
    if answered is None:
        return np.ones(queries, dtype=bool)
    mask = np.asarray(answered)
    if mask.dtype != bool:
        raise InvalidValue(f"answered mask must be boolean, got dtype {mask.dtype}")
    if mask.shape != (queries,):
        raise InvalidValue(f"answered mask must have shape ({queries},) to match the votes, got {mask.shape}")
    return mask
