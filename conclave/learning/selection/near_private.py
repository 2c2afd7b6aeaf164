"""NearPrivate (Zhao et al. 2019, Alg. 2), public side: buy labels where the private data is.

The private side (who holds the private embeddings) answers two DP questions through a
``PrivateSupport``: a DP-PCA projection of the private embeddings (Analyze Gauss, ε_dpPCA)
and, for the projected uncertain public points, noisy counts of the uncertain private points
nearest each of them (ε_support): discrete Laplace from a lone holder, Skellam through the
secure sum when several shard actors hold the data (``actors.dp_trainer.ShardSupport``). Here we pick the k most uncertain public
points, ask for both releases ONCE, and label the public points with the highest noisy
counts; smaller budgets are prefixes of the largest. Total ε = ε_dp + ε_dpPCA + ε_support
(composed in the run's ledger).

Which private points vote: the paper takes the k most uncertain private points. A rank-based
choice lets one added private point evict another, so two counts move and Lap(1/ε) would only
give 2ε. We instead let a private point vote when its entropy is at least the entropy of the
k-th most uncertain PUBLIC point — a threshold computed from public data only — so each
private point decides alone and the counts have L1 sensitivity 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from conclave.errors import InvalidValue
from conclave.learning.selection import PublicPool, check_sizes
from conclave.learning.selection.entropy import logit_entropy
from conclave.privacy.pca import normalise_rows


class PrivateSupport(Protocol):
    """The private side of NearPrivate. Implementations charge their ledger before each release."""

    def dp_projection(self, components: int) -> np.ndarray:
        """[d, p] DP-PCA projection of the (unit-normalised) private embeddings."""
        ...

    def noisy_support(self, projection: np.ndarray, public_points: np.ndarray, threshold: float) -> np.ndarray:
        """Noisy count (ε_support), per row of ``public_points`` ([m, p], projected), of the private
        points with entropy ≥ ``threshold`` whose projection is nearest to that row."""
        ...


@dataclass(frozen=True)
class NearPrivate:
    support: PrivateSupport = field(repr=False)
    components: int = 16  # p
    uncertain_factor: float = 2.0  # k = factor × the largest budget
    name: str = "near_private"

    def __post_init__(self) -> None:
        if self.components < 1:
            raise InvalidValue("components must be >= 1")
        if self.uncertain_factor < 1:
            raise InvalidValue("uncertain_factor must be >= 1 (k must be at least N)")

    def select(self, pool: PublicPool, sizes: Sequence[int], rng: np.random.Generator) -> dict[int, np.ndarray]:
        sizes = check_sizes(pool, sizes)
        k = min(len(pool), max(sizes[-1], math.ceil(self.uncertain_factor * sizes[-1])))
        entropy = logit_entropy(pool.logits)
        candidates = np.argsort(-entropy, kind="stable")[:k]
        threshold = float(entropy[candidates[-1]])
        projection = self.support.dp_projection(min(self.components, pool.embeddings.shape[1]))
        public_points = normalise_rows(pool.embeddings[candidates]) @ projection
        noisy = np.asarray(self.support.noisy_support(projection, public_points, threshold))
        if noisy.shape != (k,):
            raise InvalidValue(f"private support returned shape {noisy.shape}, expected ({k},)")
        order = candidates[np.argsort(-noisy, kind="stable")]
        return {n: order[:n] for n in sizes}
