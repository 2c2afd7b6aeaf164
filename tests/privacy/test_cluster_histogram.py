"""The histogram public-cluster votes release: each record +1 at (each of its m nearest queries,
its label), exactly min(m, B) queries per record, ties to the first query; padding votes for nothing.
Checked against a count written independently (a loop over records with a stable sort)."""
from __future__ import annotations

import numpy as np
import pytest

from conclave.privacy import cluster_histogram as histogram_module
from conclave.privacy.cluster_histogram import cluster_histogram, nearest_queries


def test_each_record_votes_for_exactly_m_queries_and_ties_go_to_the_first():
    squared = np.array([[1.0, 1.0, 5.0], [3.0, 2.0, 1.0], [4.0, 4.0, 4.0]])
    assert nearest_queries(squared, 1).tolist() == [[0], [2], [0]]  # boundary records: the first query
    assert sorted(map(sorted, nearest_queries(squared, 2).tolist())) == [[0, 1], [0, 1], [1, 2]]
    assert nearest_queries(squared, 5).shape == (3, 3)  # never more than the batch


def _by_hand(points, labels, queries, m, classes):
    counts = np.zeros((len(queries), classes), dtype=np.int64)
    for point, label in zip(points, labels):
        if label < 0:
            continue
        distances = [float(np.sum((point - q) ** 2)) for q in queries]
        for query in sorted(range(len(queries)), key=lambda j: (distances[j], j))[:m]:
            counts[query, label] += 1
    return counts


@pytest.mark.parametrize("chunk_pairs", [7, histogram_module.CHUNK_PAIRS])  # many chunks, or one
def test_the_histogram_matches_a_count_by_hand_in_chunks_and_with_padding(monkeypatch, chunk_pairs):
    monkeypatch.setattr(histogram_module, "CHUNK_PAIRS", chunk_pairs)
    rng = np.random.default_rng(0)
    points = rng.integers(0, 3, size=(40, 2)).astype(np.float64)  # integer grid: many exact ties
    labels = rng.integers(0, 4, size=40)
    labels[-5:] = -1  # padding rows to a declared size
    queries = rng.integers(0, 3, size=(6, 2)).astype(np.float64)
    for m in (1, 3, 9):
        counts = cluster_histogram(points, labels, queries, m, 4)
        assert counts.tolist() == _by_hand(points, labels, queries, m, 4).tolist()
        assert counts.sum() == 35 * min(m, 6)
