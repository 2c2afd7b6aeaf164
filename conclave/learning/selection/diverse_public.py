"""DiversePublic (Zhao et al. 2019, Alg. 1): uncertain AND diverse public points, at no privacy cost.

Embeddings of the whole public pool → PCA to ``components`` → the k most uncertain points
(logit entropy) projected → k-means into N_cluster = ⌈N / n_each⌉ groups → the ``n_each``
points nearest each centre. Only the DP model's outputs on public data are used, so this is
post-processing: ε stays ε_dp.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from sklearn.cluster import KMeans
from sklearn.decomposition import PCA

from conclave.errors import InvalidValue
from conclave.learning.selection import PublicPool, check_sizes
from conclave.learning.selection.entropy import most_uncertain


@dataclass(frozen=True)
class DiversePublic:
    components: int = 16  # p
    n_each: int = 10  # points labelled per cluster
    uncertain_factor: float = 2.0  # k = factor × N (the paper needs k > N)
    name: str = "diverse_public"

    def __post_init__(self) -> None:
        if self.components < 1 or self.n_each < 1:
            raise InvalidValue("components and n_each must be >= 1")
        if self.uncertain_factor < 1:
            raise InvalidValue("uncertain_factor must be >= 1 (k must be at least N)")

    def select(self, pool: PublicPool, sizes: Sequence[int], rng: np.random.Generator) -> dict[int, np.ndarray]:
        sizes = check_sizes(pool, sizes)
        components = min(self.components, pool.embeddings.shape[1], len(pool))
        pca = PCA(n_components=components, random_state=int(rng.integers(2**31))).fit(pool.embeddings)
        return {n: self._select_one(pool, pca, n, rng) for n in sizes}

    def _select_one(self, pool: PublicPool, pca: PCA, n: int, rng: np.random.Generator) -> np.ndarray:
        k = min(len(pool), max(n, math.ceil(self.uncertain_factor * n)))
        candidates = most_uncertain(pool.logits, k)
        projected = pca.transform(pool.embeddings[candidates])
        clusters = min(math.ceil(n / self.n_each), k)
        kmeans = KMeans(n_clusters=clusters, n_init=1, random_state=int(rng.integers(2**31))).fit(projected)
        distance = np.linalg.norm(projected - kmeans.cluster_centers_[kmeans.labels_], axis=1)
        # Rank inside each cluster by distance to its centre; then take rank 0 of every cluster,
        # rank 1 of every cluster, ... so every cluster is represented before any gets a second point.
        by_cluster = np.lexsort((distance, kmeans.labels_))
        rank = np.empty(k, dtype=np.int64)
        starts = np.searchsorted(kmeans.labels_[by_cluster], np.arange(clusters))
        rank[by_cluster] = np.arange(k) - np.repeat(starts, np.diff(np.append(starts, k)))
        eligible = np.flatnonzero(rank < self.n_each)
        chosen = eligible[np.lexsort((distance[eligible], rank[eligible]))][:n]
        if len(chosen) < n:  # clusters smaller than n_each: top up with the most uncertain left
            rest = np.setdiff1d(np.arange(k), chosen, assume_unique=True)
            chosen = np.concatenate([chosen, rest[: n - len(chosen)]])
        return candidates[chosen]
