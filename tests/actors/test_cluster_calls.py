"""Public-cluster votes are coupled across a batch (each record votes for its m nearest queries of
it), so the aggregator answers each client's call as a release of its own: two clients asking at
once are never merged into one batch, and a call's votes are those its inputs get alone. Real Ray
cluster-vote actors over digits records, a real gRPC server on 127.0.0.1, real ledger files."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conclave.actors.cluster_votes import ClusterVoteSource
from conclave.actors.owners import OwnerSource
from conclave.actors.vote_parties import RecordShare
from conclave.cluster.client import AggregatorClient
from conclave.learning.data import load_digits
from conclave.learning.data.sources import DataSource
from conclave.learning.embeddings import Flatten
from conclave.privacy.accounting.ledger import read_ledger
from conclave.privacy.mechanisms import build_mechanism
from tests.aggregators import serving, wait_for

CLASSES = tuple(str(c) for c in range(10))


class _Held:
    """The real cluster vote source, each vote call recorded (its inputs, the histogram) and the
    first held until ``release`` is set: calls arriving meanwhile queue behind it."""

    def __init__(self, source: ClusterVoteSource) -> None:
        self.source, self.calls = source, []
        self.neighbouring, self.neighbouring_lemma = source.neighbouring, source.neighbouring_lemma
        self.votes_per_query, self.batch_coupled = source.votes_per_query, source.batch_coupled
        self.votes_per_record, self.num_classes, self.local = source.votes_per_record, source.num_classes, source.local
        self.entered, self.release = threading.Event(), threading.Event()

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        histogram = self.source.votes(inputs)
        self.calls.append((inputs.copy(), histogram))
        self.entered.set()
        assert self.release.wait(30)
        return histogram

    def ready(self, timeout: float = 2.0) -> bool:
        return self.source.ready(timeout)


@pytest.fixture(scope="module")
def clusters(ray_session, tmp_path_factory):
    """One owner's 600 digits voting for their 3 nearest queries, and 150 public digits."""
    train, test = load_digits()
    path = tmp_path_factory.mktemp("cluster-owner") / "owner.npz"
    np.savez(path, x=train.x[:600], y=train.y[:600].astype(str))
    source = ClusterVoteSource([RecordShare(OwnerSource("owner", DataSource("npz", str(path), label="y"), 1,
                                                        CLASSES))], Flatten(), votes_per_record=3,
                               num_cpus_per_actor=0.25)
    assert source.batch_coupled and source.votes_per_query is None
    yield source, test.x[:150].astype(np.float32)
    source.shutdown()


def test_two_clients_asking_at_once_are_each_their_own_release(clusters, tmp_path):
    source, public = clusters
    mine, theirs, first = public[:40], public[40:140], public[140:150]
    mechanism = build_mechanism("public-clusters", sigma=2.0, votes_per_record=3)
    alone = source.votes(mine)  # what my 40 inputs get as a batch of their own
    assert not np.array_equal(alone, source.votes(np.concatenate([mine, theirs]))[:40])  # merged, they would differ

    held = _Held(source)
    with serving(held, tmp_path / "ledger.sqlite", mechanism, budget=None, label_workers=4) as (server, address), \
            AggregatorClient(address) as a, AggregatorClient(address) as b, AggregatorClient(address) as c:
        with ThreadPoolExecutor(3) as pool:
            leading = pool.submit(c.label, first)  # a third client's call holds the vote source
            assert held.entered.wait(30)
            asked = [pool.submit(a.label, mine), pool.submit(b.label, theirs)]
            wait_for(lambda: len(server.labeller._groups._queue) == 2, 30, every=0.01)  # both queued behind it
            held.release.set()
            labels = [leading.result(30)] + [call.result(30) for call in asked]
        assert [len(answer) for answer in labels] == [10, 40, 100]
        repeated = a.label(mine)  # on record: the same labels, free, no vote
    np.testing.assert_array_equal(repeated, labels[1])

    sizes = sorted(len(inputs) for inputs, _ in held.calls)
    assert sizes == [10, 40, 100]  # never one batch of 140
    (my_call,) = [(inputs, votes) for inputs, votes in held.calls if len(inputs) == 40]
    np.testing.assert_array_equal(my_call[0], mine)
    np.testing.assert_array_equal(my_call[1], alone)  # my labels' votes are those my inputs get alone
    snapshot = read_ledger(tmp_path / "ledger.sqlite")
    assert snapshot.charges == 3 and snapshot.answers == 150  # a release per call; the repeat charged nothing

