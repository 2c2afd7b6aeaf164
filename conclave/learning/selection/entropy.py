"""Uncertainty sampling by the entropy of the softmax of the logits (Settles 2009)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from conclave.learning.selection import PublicPool, check_sizes


def logit_entropy(logits: np.ndarray) -> np.ndarray:
    """Entropy (nats) of softmax(logits) per row; higher = more uncertain."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=1, keepdims=True)  # stable softmax
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -(np.exp(log_p) * log_p).sum(axis=1)


def most_uncertain(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` highest-entropy rows, most uncertain first (ties by index)."""
    return np.argsort(-logit_entropy(logits), kind="stable")[:k]


@dataclass(frozen=True)
class EntropySelection:
    name: str = "entropy"

    def select(self, pool: PublicPool, sizes: Sequence[int], rng: np.random.Generator) -> dict[int, np.ndarray]:
        sizes = check_sizes(pool, sizes)
        order = most_uncertain(pool.logits, sizes[-1])
        return {n: order[:n] for n in sizes}
