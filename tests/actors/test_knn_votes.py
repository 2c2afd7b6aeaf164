"""kNN votes over two owners' records: the same histogram as one machine's kNN over the same
Poisson sample, and only [batch, k] distances and labels out of the owners' actors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conclave.actors.knn_votes import KnnShard, KnnVoteSource, sample_stream
from conclave.actors.vote_parties import RecordShare
from conclave.learning.embeddings import Flatten, PublicPCA
from conclave.actors.owners import OwnerSource
from conclave.learning.data import load_digits
from conclave.learning.data.sources import DataSource
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.noise import NoisePolicy

CLASSES = tuple(str(c) for c in range(10))
SEED = NoisePolicy(insecure_seed=11)  # replayable draws: the test reproduces each actor's sample


@pytest.fixture(scope="module")
def owners(tmp_path_factory) -> tuple[list[OwnerSource], np.ndarray]:
    """Two owners, 150 digits each in their own .npz file, and eight public queries."""
    train, test = load_digits()
    folder = tmp_path_factory.mktemp("knn-owners")
    sources = []
    for name, rows in (("a", slice(0, 150)), ("b", slice(150, 300))):
        path = folder / f"{name}.npz"
        np.savez(path, x=train.x[rows], y=train.y[rows].astype(str))
        sources.append(OwnerSource(name, DataSource("npz", str(path), label="y"), 1, CLASSES))
    return sources, test.x[:8]


def knn_source(sources: list[OwnerSource], k: int, rate: float) -> KnnVoteSource:
    return KnnVoteSource([RecordShare(source) for source in sources], Flatten(), k, rate, noise=SEED,
                         num_cpus_per_actor=0.25)


def single_machine_votes(sources: list[OwnerSource], queries: np.ndarray, k: int, rate: float,
                         round_: int) -> tuple[np.ndarray, np.ndarray]:
    """kNN over the union of the records each actor sampled (masks replayed from the seed), ties
    by (distance, owner, position); and how many records each query included."""
    points, labels, included = [], [], []
    for index, source in enumerate(sources):
        (records,) = source.load([0])
        points.append(records.x.reshape(len(records), -1).astype(np.float64))
        labels.append(records.y)
        included.append(SEED.source(sample_stream(round_, index)).rng.random((len(queries), len(records))) < rate)
    points, labels, included = np.concatenate(points), np.concatenate(labels), np.concatenate(included, axis=1)
    flat = queries.reshape(len(queries), -1).astype(np.float64)
    votes = np.zeros((len(queries), len(CLASSES)), dtype=np.int64)
    for q, query in enumerate(flat):
        (chosen,) = np.nonzero(included[q])  # union order: owner a's records, then b's, by position
        distances = ((points[chosen] - query) ** 2).sum(axis=1)
        nearest = chosen[np.lexsort((chosen, distances))][:k]
        np.add.at(votes[q], labels[nearest], 1)
    return votes, included.sum(axis=1)


@pytest.mark.parametrize("k, rate", [(5, 0.3), (400, 0.5)])
def test_two_owners_vote_as_one_machine_knn_over_the_same_sample(ray_session, owners, k, rate):
    sources, queries = owners
    knn = knn_source(sources, k, rate)
    try:
        assert (knn.num_actors, knn.num_classes, knn.k, knn.sample_rate) == (2, 10, k, rate)
        assert knn.neighbouring == Neighbouring.ADD_REMOVE
        for round_ in (1, 2):  # a fresh sample every round
            votes = knn.votes(queries)
            expected, included = single_machine_votes(sources, queries, k, rate, round_)
            assert votes.dtype == np.int64 and votes.shape == (len(queries), 10)
            np.testing.assert_array_equal(votes, expected)
            np.testing.assert_array_equal(votes.sum(axis=1), np.minimum(k, included))
    finally:
        knn.shutdown()


def test_rate_one_is_plain_knn_and_only_distances_and_labels_leave_the_owners(ray_session, owners, driver_opens):
    sources, queries = owners
    knn = knn_source(sources, 7, 1.0)
    try:
        votes = knn.votes(queries)
        answers = knn.neighbours(queries)
        opened = driver_opens()  # before this test reads the owners' files itself, for the reference
    finally:
        knn.shutdown()
    assert not opened & {str(Path(source.data.path).resolve()) for source in sources}
    assert len(answers) == 2
    for answer in answers:  # per actor: [batch, k] squared distances and labels, nothing else
        assert isinstance(answer, tuple) and len(answer) == 2
        distances, labels = answer
        assert distances.dtype == np.float64 and distances.shape == (len(queries), 7)
        assert labels.dtype == np.int64 and labels.shape == (len(queries), 7)
        assert np.isfinite(distances).all() and (np.diff(distances, axis=1) >= 0).all()
    expected, included = single_machine_votes(sources, queries, 7, 1.0, 1)
    assert (included == 300).all()
    np.testing.assert_array_equal(votes, expected)
    assert (votes.sum(axis=1) == 7).all()


def test_a_shard_breaks_ties_by_record_position_and_pads_with_inf_and_minus_one(tmp_path):
    x = np.zeros((4, 1, 2, 2), dtype=np.float32)
    x[3] = 1.0  # three equal records, then one far away
    np.savez(tmp_path / "ties.npz", x=x, y=np.array(["3", "1", "2", "0"]))
    source = OwnerSource("ties", DataSource("npz", str(tmp_path / "ties.npz"), label="y"), 1, CLASSES)
    query = np.zeros((1, 4), dtype=np.float32)
    def shard(k: int) -> KnnShard:
        return KnnShard(source, 0, 1, Flatten(), k=k, sample_rate=1.0, index=0, noise=SEED)

    distances, labels = shard(2).neighbours(query, 1)
    np.testing.assert_array_equal(labels, [[3, 1]])
    np.testing.assert_array_equal(distances, [[0.0, 0.0]])
    distances, labels = shard(6).neighbours(query, 1)
    np.testing.assert_array_equal(labels, [[3, 1, 2, 0, -1, -1]])
    np.testing.assert_array_equal(distances, [[0.0, 0.0, 0.0, 4.0, np.inf, np.inf]])


def test_public_pca_embeds_into_the_public_datas_top_directions(owners):
    _, queries = owners
    pca = PublicPCA.fit(queries, 3)
    assert pca(queries).shape == (len(queries), 3)
    np.testing.assert_allclose(pca.components @ pca.components.T, np.eye(3), atol=1e-5)
    with pytest.raises(ValueError, match="dims must be in"):
        PublicPCA.fit(queries, 100)


def test_bad_settings_are_one_line_each(owners):
    sources, _ = owners
    capped = OwnerSource("a", sources[0].data, 1, CLASSES, records=10)
    with pytest.raises(ValueError, match="leave records unset"):
        RecordShare(capped)
    with pytest.raises(ValueError, match="k must be >= 1"):
        KnnVoteSource([RecordShare(sources[0])], Flatten(), 0, 0.5)
    with pytest.raises(ValueError, match="sample_rate must be in"):
        KnnVoteSource([RecordShare(sources[0])], Flatten(), 3, 1.5)
