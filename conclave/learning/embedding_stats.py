"""Private-side sums for NearPrivate, computed by whoever holds the private embeddings.

Both sums are separable over shards — the summed covariance of unit-normalised embeddings
and the per-public-point counts of nearest uncertain private points — so each shard holder
computes its part. A lone holder noises its own sums (``privacy.pca.AnalyzeGauss``,
``privacy.counts.LaplaceCounts``); several send only masked shares of a secure sum with their
Skellam noise shares in them (``privacy.pca.SecureAnalyzeGauss``, ``privacy.counts.SkellamCounts``).

``CentralSupport`` is the single-holder ``PrivateSupport``: it is for code that already holds
all private embeddings in one process (tests, one-machine runs). Ray runs use
``actors.dp_trainer.ShardSupport``, which computes the same sums inside the shard actors.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.counts import LaplaceCounts
from conclave.privacy.exact_distances import exact_projection, nearest_queries
from conclave.privacy.noise import NoisePolicy
from conclave.privacy.pca import AnalyzeGauss, covariance_sum, normalise_rows

__all__ = ["covariance_sum", "support_counts", "CentralSupport"]


def support_counts(embeddings: np.ndarray, entropy: np.ndarray, projection: np.ndarray,
                   public_points: np.ndarray, threshold: float) -> np.ndarray:
    """How many private points with entropy ≥ ``threshold`` have each public point as their
    nearest neighbour in the projected space (int64 [len(public_points)]); each private point
    counts at most once, for a public point chosen from its own row alone (ties by index), which
    gives the counts L1 sensitivity 1."""
    if len(embeddings) != len(entropy):
        raise InvalidValue(f"{len(embeddings)} embeddings but {len(entropy)} entropies")
    voters = np.asarray(entropy) >= threshold
    if not len(embeddings):
        return np.zeros(len(public_points), dtype=np.int64)
    # each point's projection and nearest public point on its own row alone (privacy.exact_distances),
    # for every held point, voter or not: the work is the same whoever votes
    private_points = exact_projection(normalise_rows(embeddings), np.asarray(projection).T)
    nearest = nearest_queries(private_points, public_points, 1)[:, 0]
    return np.bincount(nearest[voters], minlength=len(public_points)).astype(np.int64)


class CentralSupport:
    """``PrivateSupport`` over embeddings held in this process; charges via ``charge`` before each release."""

    def __init__(self, embeddings: np.ndarray, entropy: np.ndarray, pca: AnalyzeGauss, counts: LaplaceCounts,
                 charge: Callable[[PrivacyCharge], object], noise: NoisePolicy) -> None:
        self._embeddings = np.asarray(embeddings)
        self._entropy = np.asarray(entropy)
        self._pca, self._counts, self._charge, self._noise = pca, counts, charge, noise

    def dp_projection(self, components: int) -> np.ndarray:
        self._charge(self._pca.charge())
        return self._pca.release(covariance_sum(self._embeddings), components, self._noise.source("dp-pca"))

    def noisy_support(self, projection: np.ndarray, public_points: np.ndarray, threshold: float) -> np.ndarray:
        self._charge(self._counts.charge())
        counts = support_counts(self._embeddings, self._entropy, projection, public_points, threshold)
        return self._counts.release(counts, self._noise.source("support-counts"))
