"""The public pool cut into clusters in a public embedding: what public-cluster votes ask about.

k-means (scikit-learn, seeded: public data only) splits the pool into ``count`` clusters; each
cluster's medoid — the pool input nearest its centre — is the query the owners' records vote for,
and a label released for a medoid is then given to every member of its cluster, or each pool input
takes the weighted vote of its few nearest answered medoids' labels, which corrects a medoid whose
noised label is wrong (post-processing of released labels and public inputs: free). Largest
clusters first, so a budget that ends early labels the most inputs. scikit-learn is imported
where it is used: every student actor imports this module, and the import (with SciPy) took
1.3 s of CPU at its start, for students that never cluster.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from conclave.errors import InvalidValue


@dataclass(frozen=True, eq=False)
class PoolClusters:
    """``medoids``: a pool index per cluster, largest cluster first; ``members``: each pool input's
    cluster, as an index into ``medoids``; ``embedded``: the pool in the clusters' embedding."""

    medoids: np.ndarray  # int64 [clusters]
    members: np.ndarray  # int64 [pool]
    embedded: np.ndarray  # float64 [pool, d]

    def spread(self, labels_of_medoids: dict[int, int], nearest: int = 1, decay: float = 1.0,
               margin: float = 0.0) -> dict[int, int]:
        """Each pool index → a label from the answered medoids (``labels_of_medoids``: pool index →
        label). ``nearest`` 1: its own cluster's medoid's label (clusters without one: none). More:
        the label with the most weight among its ``nearest`` nearest answered medoids, the j-th
        nearest weighing ``decay``^j (ties: the nearer medoid's label), for every pool input whose
        winning label leads the runner-up by at least ``margin`` of the weight (the others are
        left to a semi-supervised student: that is where the wrong labels are)."""
        if nearest == 1:
            by_cluster = {cluster: labels_of_medoids[int(medoid)] for cluster, medoid in enumerate(self.medoids)
                          if int(medoid) in labels_of_medoids}
            return {int(i): by_cluster[int(c)] for i, c in enumerate(self.members) if int(c) in by_cluster}
        answered = np.asarray([int(m) for m in self.medoids if int(m) in labels_of_medoids], dtype=np.int64)
        if not len(answered):
            return {}
        from sklearn.metrics import pairwise_distances

        labels = np.asarray([labels_of_medoids[int(m)] for m in answered], dtype=np.int64)
        from sklearn.metrics import pairwise_distances

        ranked = np.argsort(pairwise_distances(self.embedded, self.embedded[answered]), axis=1,
                            kind="stable")[:, :nearest]
        weights = decay ** np.arange(ranked.shape[1], dtype=np.float64)
        scores = np.zeros((len(self.embedded), max(2, int(labels.max()) + 1)))  # a runner-up column, even if empty
        np.add.at(scores, (np.arange(len(self.embedded))[:, None], labels[ranked]), weights)
        scores[np.arange(len(self.embedded)), labels[ranked[:, 0]]] += 1e-9  # a tie goes to the nearest
        top_two = np.sort(scores, axis=1)[:, -2:]
        sure = top_two[:, 1] - top_two[:, 0] >= margin * weights.sum() - 1e-12
        return {i: int(label) for i, label in enumerate(scores.argmax(axis=1)) if sure[i]}


def cluster_pool(embedded: np.ndarray, count: int, seed: int) -> PoolClusters:
    """``count`` k-means clusters of the embedded pool ``[n, d]`` and their medoids (distinct:
    a pool input nearest two centres goes to the larger cluster, the other takes its next nearest)."""
    # scikit-learn is imported where it is used: every student actor imports this module, and most
    # never cluster (the import costs about a second of CPU in each such process).
    from sklearn.cluster import KMeans
    from sklearn.metrics import pairwise_distances_argmin

    embedded = np.asarray(embedded, dtype=np.float64)
    if not 1 <= count <= len(embedded):
        raise InvalidValue(f"clusters must be in [1, {len(embedded)}] (the pool), got {count}")
    from sklearn.cluster import KMeans
    from sklearn.metrics import pairwise_distances_argmin

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
    return PoolClusters(np.asarray(medoids, dtype=np.int64), members.astype(np.int64), embedded)
