"""The public pool cut into clusters in a public embedding: what public-cluster votes ask about.

k-means (scikit-learn, seeded: public data only) splits the pool into ``count`` clusters; each
cluster's medoid — the pool input nearest its centre — is the query the owners' records vote for,
and a label released for a medoid is then given to every member of its cluster (post-processing of
released labels and public inputs: free). Largest clusters first, so a budget that ends early
labels the most inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.cluster import KMeans
from sklearn.metrics import pairwise_distances_argmin


@dataclass(frozen=True, eq=False)
class PoolClusters:
    """``medoids``: a pool index per cluster, largest cluster first; ``members``: each pool input's
    cluster, as an index into ``medoids``."""

    medoids: np.ndarray  # int64 [clusters]
    members: np.ndarray  # int64 [pool]

    def spread(self, labels_of_medoids: dict[int, int]) -> dict[int, int]:
        """Each pool index → the label released for its cluster's medoid (clusters without one: none)."""
        by_cluster = {cluster: labels_of_medoids[int(medoid)] for cluster, medoid in enumerate(self.medoids)
                      if int(medoid) in labels_of_medoids}
        return {int(i): by_cluster[int(c)] for i, c in enumerate(self.members) if int(c) in by_cluster}


def cluster_pool(embedded: np.ndarray, count: int, seed: int) -> PoolClusters:
    """``count`` k-means clusters of the embedded pool ``[n, d]`` and their medoids (distinct:
    a pool input nearest two centres goes to the larger cluster, the other takes its next nearest)."""
    embedded = np.asarray(embedded, dtype=np.float64)
    if not 1 <= count <= len(embedded):
        raise ValueError(f"clusters must be in [1, {len(embedded)}] (the pool), got {count}")
    kmeans = KMeans(n_clusters=count, random_state=seed, n_init=1).fit(embedded)
    order = np.argsort(-np.bincount(kmeans.labels_, minlength=count), kind="stable")
    centres = kmeans.cluster_centers_[order]
    members = np.argsort(order)[kmeans.labels_]  # cluster ids renumbered largest first
    medoids: list[int] = []
    taken = np.zeros(len(embedded), dtype=bool)
    for cluster, centre in enumerate(centres):
        candidates = np.flatnonzero((members == cluster) & ~taken)
        if not len(candidates):  # every member taken by a larger cluster: its nearest free input
            candidates = np.flatnonzero(~taken)
        pick = int(candidates[pairwise_distances_argmin(centre[None], embedded[candidates])[0]])
        taken[pick] = True
        medoids.append(pick)
    return PoolClusters(np.asarray(medoids, dtype=np.int64), members.astype(np.int64))
