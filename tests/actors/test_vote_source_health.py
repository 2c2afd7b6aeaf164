"""Every vote source reports health: the real gRPC aggregator over real kNN shard actors loses
one (killed: Ray restarts it; killed for good: the source starts it again), turns NOT_SERVING,
comes back to SERVING and answers fresh inputs again; a check begun before a failed vote cannot
bring health back; a source that cannot say is refused."""
from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conclave.actors.aggregator import AggregatorServer
from conclave.actors.knn_votes import KnnVoteSource
from conclave.actors.vote_parties import RecordShare
from conclave.actors.owners import OwnerSource
from conclave.cluster.client import AggregatorClient
from conclave.learning.data import load_digits
from conclave.learning.data.sources import DataSource
from conclave.learning.embeddings import Flatten
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.mechanisms import build_mechanism
from conclave.privacy.mechanisms.private_knn import PrivateKnnMechanism
from tests.aggregators import DELTA, INPUT_SHAPE, serving

CLASSES = tuple(str(c) for c in range(10))
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
CHECK = health_pb2.HealthCheckRequest()
RATE = 0.5


@pytest.fixture(scope="module")
def knn(ray_session, tmp_path_factory):
    """kNN votes of two owners (150 digits each, their own .npz files), one actor each; and
    public queries."""
    train, test = load_digits()
    folder = tmp_path_factory.mktemp("knn-health")
    shares = []
    for name, rows in (("a", slice(0, 150)), ("b", slice(150, 300))):
        np.savez(folder / f"{name}.npz", x=train.x[rows], y=train.y[rows].astype(str))
        shares.append(RecordShare(OwnerSource(name, DataSource("npz", str(folder / f"{name}.npz"), label="y"), 1,
                                           CLASSES)))
    source = KnnVoteSource(shares, Flatten(), 10, RATE, num_cpus_per_actor=0.25)
    yield source, test.x.astype(np.float32)
    source.shutdown()


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda shard: os.getpid()), timeout=60)


def _statuses_until(health, wanted: int, seconds: float) -> list[int]:
    """Health statuses seen, polled every 20 ms, up to the first ``wanted`` (or ``seconds``)."""
    seen, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.append(health.Check(CHECK, timeout=5).status)
        if seen[-1] == wanted:
            break
        time.sleep(0.02)
    return seen


def _mechanism() -> PrivateKnnMechanism:
    return PrivateKnnMechanism(sigma1=5.0, threshold=2.0, sigma2=3.0, sample_rate=RATE)


@pytest.mark.parametrize("past_restarts", [False, True], ids=["ray-restarts-it", "killed-for-good"])
def test_a_killed_knn_actor_turns_health_not_serving_then_serving_and_labels_are_answered_again(
        knn, tmp_path, past_restarts):
    source, public = knn
    offset = 40 if past_restarts else 0  # fresh inputs in each case
    with serving(source, tmp_path / "ledger.sqlite", mechanism=_mechanism(), budget=None,
                 health_interval=0.3) as (_, address), \
            AggregatorClient(address) as client, grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert client.label(public[offset:offset + 4]).shape == (4,)
        victim = source.roster.actors[0]
        if past_restarts:
            ray.kill(victim, no_restart=True)  # as after Ray's last restart: the source starts it anew
        else:
            os.kill(_pid(victim), signal.SIGKILL)  # Ray restarts it; it reloads its owner's records
        down = _statuses_until(health, NOT_SERVING, 30)
        assert down[-1] == NOT_SERVING, down
        up = _statuses_until(health, SERVING, 90)
        assert up[-1] == SERVING, up
        labels = client.label(public[offset + 4:offset + 12])
        assert labels.shape == (8,) and client.budget()["queries_answered"] + client.budget()["queries_abstained"] == 12
    assert (source.roster.actors[0] is not victim) == past_restarts  # replaced only when Ray had given up
    assert source.ready(timeout=30)


class _Stale:
    """A user's vote source whose health checks can be held while they run, each answering with
    what held when it began (as a probe answered by an actor that was stopped)."""

    neighbouring, neighbouring_lemma = Neighbouring.ADD_REMOVE, "one teacher per record"
    votes_per_query, batch_coupled, num_classes, local = 5, False, 10, False

    def __init__(self) -> None:
        self.up = True
        self.hold = threading.Event()  # set: each check waits for one ``gate.release()``
        self.gate = threading.Semaphore(0)
        self.checking = threading.Event()  # a held check has begun

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        if not self.up:
            raise TimeoutError("the voters gave no votes within 1 s")
        return np.tile(np.array([5, 0, 0, 0, 0, 0, 0, 0, 0, 0]), (len(inputs), 1))

    def ready(self, timeout: float = 2.0) -> bool:
        answer = self.up
        if self.hold.is_set():
            self.checking.set()
            self.gate.acquire(timeout=30)
        return answer


def test_a_check_begun_before_a_failed_vote_does_not_bring_health_back(tmp_path):
    # Before: a probe sent while an actor was stopped, answered once it resumed, turned health
    # SERVING although a vote had failed meanwhile (its abandoned call still running).
    source = _Stale()
    public = np.random.default_rng(0).random((8, *INPUT_SHAPE), dtype=np.float32)
    with serving(source, tmp_path / "ledger.sqlite", health_interval=0.1) as (_, address), \
            AggregatorClient(address, timeout=10) as client, grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert client.label(public[:2]).shape == (2,)
        source.hold.set()
        assert source.checking.wait(10)  # a check is under way, and will say "up"
        source.up = False
        with pytest.raises(grpc.RpcError) as failed:
            client.label(public[2:4])
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        source.checking.clear()
        source.gate.release()  # the stale check answers "up"
        assert source.checking.wait(10)  # the next check is held: health stays as the stale one left it
        assert health.Check(CHECK, timeout=5).status == NOT_SERVING
        source.up = True
        source.hold.clear()
        source.gate.release()
        assert _statuses_until(health, SERVING, 10)[-1] == SERVING
        assert client.label(public[4:8]).shape == (4,)


class _Silent:
    """A vote source that cannot say whether its voters are up."""

    neighbouring, neighbouring_lemma = Neighbouring.ADD_REMOVE, "one teacher per record"
    votes_per_query, batch_coupled, num_classes, local = None, False, 10, False

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        return np.zeros((len(inputs), 10), dtype=np.int64)


def test_a_vote_source_without_ready_is_refused_in_one_line(tmp_path):
    with PrivacyLedger(tmp_path / "ledger.sqlite", DELTA) as ledger, \
            pytest.raises(TypeError, match=r"^vote source _Silent has no ready\(timeout\) method"):
        AggregatorServer(_Silent(), build_mechanism("gnmax", sigma=2.0), ledger, INPUT_SHAPE)
