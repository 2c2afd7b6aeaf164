"""A record's nearest queries (cluster votes) and a query's nearest records (kNN votes) chosen on
exact per-record distances: checked against a count written independently, and on near-tie sets
where a matrix product's rounding flips choices when another record is added or removed (the
outside probe's tie set: records equidistant in exact arithmetic from two public queries)."""
from __future__ import annotations

import numpy as np
import pytest

from conclave.privacy import exact_distances
from conclave.privacy.cluster_histogram import cluster_histogram
from conclave.privacy.exact_distances import exact_projection, exact_squared, nearest_queries, nearest_records


def _by_hand(points, labels, queries, m, classes):
    counts = np.zeros((len(queries), classes), dtype=np.int64)
    for point, label in zip(points, labels):
        if label < 0:
            continue
        distances = [float(np.sum((point - q) ** 2)) for q in queries]
        for query in sorted(range(len(queries)), key=lambda j: (distances[j], j))[:m]:
            counts[query, label] += 1
    return counts


def test_each_record_votes_for_exactly_m_queries_and_ties_go_to_the_first():
    queries = np.array([[0.0, 1.0], [0.0, -1.0], [5.0, 0.0]])
    points = np.array([[0.0, 0.0], [4.0, 0.0], [-3.0, 0.0]])
    assert nearest_queries(points, queries, 1).tolist() == [[0], [2], [0]]  # a tie: the first query
    assert nearest_queries(points, queries, 2).tolist() == [[0, 1], [2, 0], [0, 1]]
    assert nearest_queries(points, queries, 5).shape == (3, 3)  # never more than the batch


@pytest.mark.parametrize("chunk_pairs", [7, exact_distances.CHUNK_PAIRS])  # many chunks, or one
def test_the_histogram_matches_a_count_by_hand_in_chunks_and_with_padding(monkeypatch, chunk_pairs):
    monkeypatch.setattr(exact_distances, "CHUNK_PAIRS", chunk_pairs)
    rng = np.random.default_rng(0)
    points = rng.integers(0, 3, size=(40, 2)).astype(np.float64)  # integer grid: many exact ties
    labels = rng.integers(0, 4, size=40)
    labels[-5:] = -1  # padding rows to a declared size
    queries = rng.integers(0, 3, size=(6, 2)).astype(np.float64)
    for m in (1, 3, 9):
        counts = cluster_histogram(points, labels, queries, m, 4)
        assert counts.tolist() == _by_hand(points, labels, queries, m, 4).tolist()
        assert counts.sum() == 35 * min(m, 6)


def _tie_set(rng: np.random.Generator, records: int, batch: int, dims: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """``batch`` queries and ``records`` points equidistant, in exact arithmetic, from queries 0 and
    1 (on their bisector) and nearer to them than to the rest: every choice is a near tie in floats."""
    queries = rng.normal(size=(batch, dims)) * 50.0
    queries[1] = queries[0] + rng.normal(size=dims)  # a close pair, far from the rest
    mid, normal = (queries[0] + queries[1]) / 2, queries[1] - queries[0]
    offsets = rng.normal(size=(records, dims)) * 0.01
    offsets -= np.outer(offsets @ normal / (normal @ normal), normal)  # onto the bisector plane
    return mid + offsets, queries


@pytest.mark.parametrize("rows", [2998, 6666])  # 2998: a removal leaves a one-row chunk (a matrix-vector path)
def test_removing_any_record_of_a_tie_set_moves_the_histogram_by_m_at_most(monkeypatch, rows):
    monkeypatch.setattr(exact_distances, "CHUNK_PAIRS", 600 * rows)
    rng = np.random.default_rng(1)
    points, queries = _tie_set(rng, 3000, 600)
    labels = rng.integers(0, 10, size=len(points))
    for m in (1, 2):
        full = cluster_histogram(points, labels, queries, m, 10)
        for removed in rng.choice(len(points), size=15, replace=False):
            keep = np.arange(len(points)) != removed
            moved = full - cluster_histogram(points[keep], labels[keep], queries, m, 10)
            assert np.abs(moved).sum() == m and moved.min() == 0  # exactly its own m votes, nothing else


def test_a_matrix_product_breaks_the_tie_set_that_exact_distances_keep():
    """What the probe found, so the tests above are known to bite: ‖x‖² − 2x·q + ‖q‖² in one product
    chooses differently for a record alone (a one-row chunk) than among others."""
    rng = np.random.default_rng(1)
    points, queries = _tie_set(rng, 300, 600)

    def by_product(x):
        squared = np.einsum("ij,ij->i", x, x)[:, None] - 2.0 * (x @ queries.T) + np.einsum("ij,ij->i", queries, queries)
        return np.argsort(squared, axis=1, kind="stable")[:, 0]

    alone = np.concatenate([by_product(points[i:i + 1]) for i in range(len(points))])
    assert (by_product(points) != alone).any()
    exact_alone = np.concatenate([nearest_queries(points[i:i + 1], queries, 1) for i in range(len(points))])
    assert (nearest_queries(points, queries, 1) == exact_alone).all()


def test_a_record_chooses_the_same_queries_alone_as_among_others(monkeypatch):
    rng = np.random.default_rng(2)
    points, queries = _tie_set(rng, 500, 200)
    monkeypatch.setattr(exact_distances, "CHUNK_PAIRS", 200 * 37)  # chunks of 37 rows: records at every offset
    together = nearest_queries(points, queries, 3)
    alone = np.concatenate([nearest_queries(points[i:i + 1], queries, 3) for i in range(len(points))])
    assert (together == alone).all()


def test_a_querys_nearest_records_lose_only_the_removed_one_on_a_tie_set():
    rng = np.random.default_rng(3)
    query = rng.normal(size=16) * 50.0
    direction = rng.normal(size=16)
    # records on a sphere around the query (the same offset, permuted and sign-flipped): near ties
    points = np.stack([query + rng.permutation(direction) * rng.choice([-1, 1], size=16) for _ in range(400)])
    norms = np.einsum("ij,ij->i", points, points)

    def nearest(rows, k):
        approximate = norms[rows] - 2.0 * (points[rows] @ query) + query @ query
        chosen, _ = nearest_records(points[rows], norms[rows], query, approximate, np.arange(len(rows)), k)
        return rows[chosen]

    everyone = np.arange(len(points))
    full = nearest(everyone, 25)
    for removed in full[::3]:
        without = nearest(everyone[everyone != removed], 25)
        assert set(full) - set(without) == {removed} and len(set(without) - set(full)) == 1
        assert [r for r in full if r != removed] == list(without[:24])  # the others keep their order


def test_exact_sums_and_projections_match_a_loop_written_by_hand():
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(30, 7)), rng.normal(size=(30, 7))
    by_hand = []
    for x, y in zip(a, b):
        total = 0.0
        for u, v in zip(x, y):
            total += (u - v) * (u - v)
        by_hand.append(total)
    assert exact_squared(a, b).tolist() == by_hand
    components = rng.normal(size=(3, 7))
    projected = exact_projection(a, components)
    assert np.allclose(projected, a @ components.T, atol=1e-5)
    assert (exact_projection(a[5:6], components) == projected[5:6]).all()  # a row alone: the same bits
