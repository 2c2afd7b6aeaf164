"""A cold start from the public pool's structure: before any answer there is no model to ask,
so the first queries are typical inputs, one per region of the pool, rather than random ones.

The embedding is public: the flattened inputs, projected by a PCA fitted on the pool alone;
k-means runs on the inputs not asked yet. The input nearest each centre is asked, largest
cluster first (the most typical inputs come first should the budget end mid-round). scikit-learn
is imported when a cold start runs: every student actor imports this module, most never use it.
"""
from __future__ import annotations

import numpy as np
from conclave.errors import InvalidValue

MAX_DIMS = 50  # k-means in a few dozen PCA dimensions: the pixels' noise left out, fast on large pools


def kmeans_cold_start(pool: np.ndarray, candidates: np.ndarray, size: int, seed: int) -> np.ndarray:
    """``size`` distinct indices from ``candidates`` (indices into ``pool``, the inputs not asked
    yet): for each of ``size`` k-means centres of the candidates, in the pool's PCA embedding,
    the candidate nearest it not picked for an earlier centre; largest cluster first."""
    # scikit-learn is imported here: every student actor imports this module, most start at random.
    from sklearn.cluster import KMeans
    from sklearn.decomposition import PCA
    from sklearn.metrics import pairwise_distances

    candidates = np.asarray(candidates, dtype=np.int64)
    if not 1 <= size <= len(candidates):
        raise InvalidValue(f"size must be in [1, {len(candidates)}] (the candidates), got {size}")
    from sklearn.cluster import KMeans
    from sklearn.decomposition import PCA
    from sklearn.metrics import pairwise_distances

    flat = pool.reshape(len(pool), -1).astype(np.float64)
    dims = min(MAX_DIMS, *flat.shape)
    embedded = PCA(n_components=dims, random_state=seed).fit(flat).transform(flat[candidates])
    kmeans = KMeans(n_clusters=size, random_state=seed, n_init="auto").fit(embedded)
    by_size = np.argsort(-np.bincount(kmeans.labels_, minlength=size), kind="stable")
    distances = pairwise_distances(kmeans.cluster_centers_[by_size], embedded)
    picked: list[int] = []
    for row in distances:
        row[picked] = np.inf  # distinct: a point nearest two centres goes to the larger cluster
        picked.append(int(row.argmin()))
    return candidates[picked]
