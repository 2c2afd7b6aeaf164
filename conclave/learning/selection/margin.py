"""Uncertainty sampling by the difference of the two largest logits (smallest first)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from conclave.errors import InvalidValue
from conclave.learning.selection import PublicPool, check_sizes


def top_two_difference(logits: np.ndarray) -> np.ndarray:
    """Largest logit minus the second largest, per row; smaller = more uncertain."""
    if logits.shape[1] < 2:
        raise InvalidValue("the margin needs at least two classes")
    top2 = np.partition(np.asarray(logits, dtype=np.float64), -2, axis=1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


@dataclass(frozen=True)
class MarginSelection:
    name: str = "margin"

    def select(self, pool: PublicPool, sizes: Sequence[int], rng: np.random.Generator) -> dict[int, np.ndarray]:
        sizes = check_sizes(pool, sizes)
        order = np.argsort(top_two_difference(pool.logits), kind="stable")[: sizes[-1]]
        return {n: order[:n] for n in sizes}
