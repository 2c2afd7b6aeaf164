"""The histogram a public-cluster release noises (reverse kNN, ``privacy.mechanisms.public_clusters``).

For a batch of B public queries, each record adds 1 at (each of its m nearest queries, its label).
Exactly min(m, B) distinct queries per record, chosen on exact per-record distances with ties by
query index (``privacy.exact_distances.nearest_queries``): the choice is a function of that record
and the queries alone, bit for bit, so adding or removing a record moves at most m cells by one
(``CLUSTER_LEMMA``), whatever the other records are.

Plain numpy, no Ray: the owner's vote actors (``actors.cluster_votes``) call it on their records.
"""
from __future__ import annotations

import numpy as np

from conclave.privacy.exact_distances import nearest_queries


def cluster_histogram(points: np.ndarray, labels: np.ndarray, queries: np.ndarray, m: int,
                      num_classes: int, norms: np.ndarray | None = None) -> np.ndarray:
    """``int64[B, num_classes]``: the votes of ``points`` (float64 ``[n, d]``, labels ``[n]``; a
    label below 0 is padding and votes for nothing) for their ``m`` nearest ``queries`` ``[B, d]``.
    ``norms``: the points' squared norms, when the caller keeps them (they only prune)."""
    batch = len(queries)
    nearest = nearest_queries(points, queries, m, norms)
    column = np.asarray(labels)[:, None]
    cells = (nearest * num_classes + column)[np.broadcast_to(column >= 0, nearest.shape)]
    return np.bincount(cells, minlength=batch * num_classes).reshape(batch, num_classes).astype(np.int64)
