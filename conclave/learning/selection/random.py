"""Baseline: budgets filled uniformly at random (nested: each selection extends the smaller one)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from conclave.learning.selection import PublicPool, check_sizes


@dataclass(frozen=True)
class RandomSelection:
    name: str = "random"

    def select(self, pool: PublicPool, sizes: Sequence[int], rng: np.random.Generator) -> dict[int, np.ndarray]:
        sizes = check_sizes(pool, sizes)
        order = rng.permutation(len(pool))
        return {n: order[:n] for n in sizes}
