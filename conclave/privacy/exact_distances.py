"""Nearest neighbours whose choice is a function of one record and the queries alone, bit for bit.

A matrix product ‖x‖² − 2x·q + ‖q‖² rounds a record's row by its position and the array's shape,
so a near tie between two queries can flip when another record is added or removed, and the
one-record lemmas of kNN and public-cluster votes fail as executed. Here the distance that decides
is ``exact_squared``: Σ_j (x_j − q_j)² summed in the order j = 0 … d−1, one correctly rounded IEEE
operation at a time, so it has the same bits wherever the record sits. The matrix product only
prunes: its rounding error is bounded (``PRUNE_SLACK``; Higham, *Accuracy and Stability of
Numerical Algorithms*, §3.1), so every query or record that could be chosen on exact sums stays a
candidate, and the choice among candidates is made on exact sums, ties by index. docs/privacy.md
("Distances in floating point") gives the argument.
"""
from __future__ import annotations

import numpy as np

UNIT_ROUNDOFF = 2.0 ** -53
CHUNK_PAIRS = 4_000_000  # (record, query) pairs pruned at once: about 32 MiB whatever the sizes


def exact_squared(points: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """``float64[p]``: Σ_j (points[i, j] − queries[i, j])² for paired rows ``[p, d]``, summed in
    column order with elementwise operations only — each entry a function of its two rows alone."""
    points, queries = np.asarray(points, dtype=np.float64), np.asarray(queries, dtype=np.float64)
    total = np.zeros(len(points))
    difference = np.empty(len(points))
    for column in range(points.shape[1]):
        np.subtract(points[:, column], queries[:, column], out=difference)
        np.multiply(difference, difference, out=difference)
        np.add(total, difference, out=total)
    return total


def exact_projection(values: np.ndarray, components: np.ndarray) -> np.ndarray:
    """float32 ``[n, dims]``: ``values [n, d] @ components.T`` with each entry summed over d in
    order, in float64, by elementwise operations only (a function of its own row alone)."""
    columns = np.ascontiguousarray(np.asarray(values, dtype=np.float64).T)
    components = np.asarray(components, dtype=np.float64)
    total = np.zeros((columns.shape[1], len(components)))
    term = np.empty_like(total)
    for column, weights in zip(columns, components.T):
        np.multiply(column[:, None], weights[None, :], out=term)
        np.add(total, term, out=total)
    return total.astype(np.float32)


def prune_slack(dims: int, point_norms: np.ndarray, query_norms: np.ndarray) -> np.ndarray:
    """An upper bound on |matrix-product distance − ``exact_squared``| for norms (not squared)
    broadcast against each other: both are within γ_{d+3}·(‖x‖ + ‖q‖)² of the real distance
    (dot products: |fl(x·q) − x·q| ≤ γ_d‖x‖‖q‖ in any summation order, with or without FMA), so
    twice that, inflated fourfold for the rounding of the bound itself, plus subnormal headroom."""
    gamma = (dims + 4) * UNIT_ROUNDOFF
    return 8.0 * gamma * (point_norms + query_norms) ** 2 + 8.0 * (dims + 4) * np.finfo(np.float64).tiny


def nearest_queries(points: np.ndarray, queries: np.ndarray, m: int,
                    squared_norms: np.ndarray | None = None) -> np.ndarray:
    """``int64[n, min(m, B)]``: each record's min(m, B) nearest ``queries`` ``[B, d]`` by
    ``exact_squared``, ties broken by query index — the same for a record wherever it sits."""
    points, queries = np.asarray(points, dtype=np.float64), np.asarray(queries, dtype=np.float64)
    batch = len(queries)
    m = min(m, batch)
    if m == batch:  # every query is chosen: no distance decides anything
        return np.broadcast_to(np.arange(batch), (len(points), batch)).copy()
    squared_norms = np.einsum("ij,ij->i", points, points) if squared_norms is None else squared_norms
    query_squared = np.einsum("ij,ij->i", queries, queries)
    query_norms = np.sqrt(query_squared)
    rows = max(1, CHUNK_PAIRS // max(batch, 1))
    parts = [np.zeros((0, m), dtype=np.int64)]
    for start in range(0, len(points), rows):
        chunk = points[start:start + rows]
        approximate = squared_norms[start:start + rows, None] - 2.0 * (chunk @ queries.T) + query_squared[None, :]
        slack = prune_slack(points.shape[1], np.sqrt(squared_norms[start:start + rows])[:, None], query_norms[None, :])
        # Among the m smallest approximations, the largest upper bound caps the m-th exact distance;
        # a query whose lower bound passes it cannot be among the m nearest.
        first = np.argpartition(approximate, m - 1, axis=1)[:, :m]
        cap = np.take_along_axis(approximate + slack, first, axis=1).max(axis=1)
        lower = approximate - slack
        record, query = np.nonzero((lower <= cap[:, None]) | ~np.isfinite(lower) | ~np.isfinite(cap)[:, None])
        exact = exact_squared(chunk[record], queries[query])
        order = np.lexsort((query, exact, record))  # by record, then exact distance, then query index
        record, query = record[order], query[order]
        starts = np.searchsorted(record, np.arange(len(chunk)))
        rank = np.arange(len(record)) - starts[record]
        parts.append(query[rank < m].reshape(len(chunk), m))
    return np.concatenate(parts)


def nearest_records(points: np.ndarray, squared_norms: np.ndarray, query: np.ndarray, approximate: np.ndarray,
                    positions: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The (up to) ``k`` of ``positions`` (ascending) nearest to ``query`` ``[d]`` by
    ``exact_squared``, nearest first, ties by position, with their exact distances;
    ``approximate``: the matrix-product distances of all ``points`` to ``query``, used to prune."""
    if len(positions) > k:
        slack = prune_slack(len(query), np.sqrt(squared_norms[positions]), float(np.sqrt(query @ query)))
        lower, upper = approximate[positions] - slack, approximate[positions] + slack
        first = np.argpartition(approximate[positions], k - 1)[:k]
        cap = upper[first].max()
        positions = positions[(lower <= cap) | ~np.isfinite(lower) | (not np.isfinite(cap))]
    exact = exact_squared(points[positions], np.broadcast_to(query, (len(positions), len(query))))
    order = np.lexsort((positions, exact))[:k]
    return positions[order], exact[order]
