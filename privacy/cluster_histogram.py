"""The histogram a public-cluster release noises (reverse kNN, ``privacy.mechanisms.public_clusters``).

For a batch of B public queries, each record adds 1 at (each of its m nearest queries, its label).
Exactly min(m, B) distinct queries per record, ties by query order (``nearest_queries``): the choice
is a function of that record and the queries alone, so adding or removing a record moves at most m
cells by one (``CLUSTER_LEMMA``), whatever the other records are.

Plain numpy, no Ray: the owner's vote actors (``actors.cluster_votes``) call it on their records.
"""
from __future__ import annotations

import numpy as np

CHUNK_PAIRS = 4_000_000  # (record, query) distances at once: about 32 MiB whatever the sizes


def nearest_queries(squared: np.ndarray, m: int) -> np.ndarray:
    """For squared distances ``[records, B]``: each record's min(m, B) nearest queries, ties broken
    by query order (so the choice is a function of the record and the queries alone)."""
    m = min(m, squared.shape[1])
    chosen = np.argpartition(squared, m - 1, axis=1)[:, :m]
    kth = np.take_along_axis(squared, chosen, axis=1).max(axis=1, keepdims=True)
    tied = (squared <= kth).sum(axis=1) > m
    if tied.any():  # more candidates than m at the m-th distance: the first in query order win
        chosen[tied] = np.argsort(squared[tied], axis=1, kind="stable")[:, :m]
    return chosen


def cluster_histogram(points: np.ndarray, labels: np.ndarray, queries: np.ndarray, m: int,
                      num_classes: int, norms: np.ndarray | None = None) -> np.ndarray:
    """``int64[B, num_classes]``: the votes of ``points`` (float64 ``[n, d]``, labels ``[n]``; a
    label below 0 is padding and votes for nothing) for their ``m`` nearest ``queries`` ``[B, d]``.
    ``norms``: the points' squared norms, when the caller keeps them."""
    queries = np.asarray(queries, dtype=np.float64)
    batch = len(queries)
    norms = np.einsum("ij,ij->i", points, points) if norms is None else norms
    query_norms = np.einsum("ij,ij->i", queries, queries)
    counts = np.zeros(batch * num_classes, dtype=np.int64)
    rows = max(1, CHUNK_PAIRS // max(batch, 1))
    for start in range(0, len(labels), rows):
        chunk = points[start:start + rows]
        squared = norms[start:start + rows, None] - 2.0 * chunk @ queries.T + query_norms[None, :]
        nearest = nearest_queries(squared, m)
        chunk_labels = labels[start:start + rows, None]
        cells = (nearest * num_classes + chunk_labels)[np.broadcast_to(chunk_labels >= 0, nearest.shape)]
        counts += np.bincount(cells, minlength=len(counts))
    return counts.reshape(batch, num_classes)
