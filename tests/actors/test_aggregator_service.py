"""The aggregator as a service exposed to strangers: it cannot be starved, each status code
has one meaning, TLS works, a lost teacher is recovered from, answers survive a restart.

Real servers on 127.0.0.1 over real teacher actors (the shared ``teachers`` fixture), real
certificates, real SIGKILLs of a teacher's process; bounded in count and time.
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

from conclave.actors.aggregator import ServerSettings
from conclave.actors.teacher import TeacherPool, TeacherSource
from conclave.cluster.client import AggregatorClient, is_budget_refusal
from conclave.learning.train_config import TrainConfig
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.filter import RenyiFilter
from conclave.privacy.accounting.rdp import epsilon_from_rdp
from conclave.privacy.mechanisms import build_mechanism
from conclave.protos import aggregator_pb2, aggregator_pb2_grpc
from tests.aggregators import DELTA, INPUT_SHAPE, serving, wait_for
from tests.certificates import make_certificates

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def public(teachers) -> np.ndarray:
    from conclave.learning.data import load_digits

    return load_digits()[1].x


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def raw_label(channel: grpc.Channel):
    """Label with no serializer: the test decides every byte on the wire."""
    return channel.unary_unary("/conclave.v1.Aggregator/Label", request_serializer=None,
                               response_deserializer=aggregator_pb2.LabelReply.FromString)


def test_idle_streams_authenticated_or_not_never_starve_other_calls(teachers, public, tmp_path):
    # Before: 8 idle streams blocked an 8-thread server; here 16 of each kind stay open.
    with serving(teachers, tmp_path / "ledger.sqlite", token="t", label_workers=2) as (_, address), \
            grpc.insecure_channel(address) as channel:
        metadata = (("authorization", "Bearer t"),)
        release = threading.Event()

        def idle_requests():
            release.wait(30)
            return
            yield  # a generator that sends nothing until released

        stub = aggregator_pb2_grpc.AggregatorStub(channel)
        reflection_stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        calls = [stub.LabelStream(idle_requests(), metadata=metadata) for _ in range(16)]
        calls += [reflection_stub.ServerReflectionInfo(idle_requests()) for _ in range(16)]
        calls += [health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest()) for _ in range(4)]
        try:
            time.sleep(0.5)  # every stream is open on the server now
            started = time.perf_counter()
            budget = stub.GetBudget(aggregator_pb2.BudgetRequest(), metadata=metadata, timeout=2)
            labels = stub.Label(aggregator_pb2.LabelRequest(inputs=aggregator_pb2.Tensor(
                shape=[2, *INPUT_SHAPE], dtype="float32", data=public[:2].astype("<f4").tobytes())),
                metadata=metadata, timeout=2)
            assert time.perf_counter() - started < 4
            assert budget.mechanism == "gnmax" and len(labels.labels) == 2
        finally:
            release.set()
            for call in calls:
                call.cancel()


def test_a_stream_left_idle_is_closed_with_deadline_exceeded(teachers, public, tmp_path):
    with serving(teachers, tmp_path / "ledger.sqlite", stream_idle_timeout=0.5) as (_, address), \
            AggregatorClient(address) as client:
        pending: queue.Queue = queue.Queue()

        def batches():
            yield public[:2]
            pending.get(timeout=10)  # then nothing, until the server gives up
            yield public[2:4]

        replies = client.label_stream(batches())
        assert len(next(replies)) == 2
        error = rpc_error(lambda: next(replies))
        pending.put(None)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "open a new one" in error.details()


def test_random_bytes_and_oversized_fields_are_invalid_argument_with_short_messages(teachers, public, tmp_path, caplog):
    rng = np.random.default_rng(0)
    with serving(teachers, tmp_path / "ledger.sqlite") as (server, address), grpc.insecure_channel(address) as channel:
        label = raw_label(channel)
        before = server.budget()
        codes, longest = set(), 0
        with caplog.at_level(logging.INFO, logger="conclave.actors.aggregator"):
            for size in (1, 3, 10, 100, 1000, 5000) * 20:
                error = rpc_error(lambda: label(rng.bytes(size), timeout=5))
                codes.add(error.code())
                longest = max(longest, len(error.details()))
            huge_dtype = aggregator_pb2.LabelRequest(inputs=aggregator_pb2.Tensor(
                shape=[1, *INPUT_SHAPE], dtype="x" * 10_000, data=public[:1].astype("<f4").tobytes()))
            error = rpc_error(lambda: label(huge_dtype.SerializeToString(), timeout=5))
        assert codes == {grpc.StatusCode.INVALID_ARGUMENT}
        assert longest < 200
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and len(error.details()) < 200
        assert "10000 characters" in error.details()
        # one rate-limited line, not a traceback per request
        lines = [r for r in caplog.records if r.name == "conclave.actors.aggregator"]
        assert 1 <= len(lines) <= 3 and not any(r.exc_info for r in lines)
        assert server.budget() == before  # nothing spent, nothing counted


def test_budget_refusal_is_the_only_resource_exhausted_and_carries_its_reason(teachers, public, tmp_path):
    # A filter at order 16 that admits 5 GNMax answers at σ = 8 (5·16/64 RDP), not 6.
    order = 16.0
    budget = RenyiFilter(epsilon_from_rdp([order], [5.5 * order / 64], DELTA)[0], DELTA, order)
    with serving(teachers, tmp_path / "ledger.sqlite", mechanism=build_mechanism("gnmax", sigma=8.0),
                 budget=budget, max_batch=4) as (_, address), AggregatorClient(address) as client:
        answered = client.label(public[:4])
        client.label(public[4:5])
        refusal = rpc_error(lambda: client.label(public[10:12]))
        assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and is_budget_refusal(refusal)
        # A batch mixing answered and new inputs: the answered ones still come, the new are refused.
        mixed = client.label_reply(np.concatenate([public[:2], public[20:22]]))
        assert (mixed.labels[:2] == answered[:2]).all() and mixed.refused.tolist() == [False, False, True, True]
        assert (mixed.labels[2:] == -1).all() and mixed.answered == 2
        # A message over the port's size limit: gRPC's own RESOURCE_EXHAUSTED, not a budget refusal.
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as channel:
            oversized = rpc_error(lambda: raw_label(channel)(b"\x0a" + b"\x00" * (8 << 20), timeout=10))
        assert oversized.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not is_budget_refusal(oversized)
        # Over max_batch but under the size limit: a clear INVALID_ARGUMENT.
        assert rpc_error(lambda: client.label(public[:6])).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_answers_survive_a_restart_free_and_identical(teachers, public, tmp_path):
    # σ = 40 over 4 teachers: fresh noise would change most of 60 labels.
    noisy, path, x = build_mechanism("gnmax", sigma=40.0), tmp_path / "ledger.sqlite", public[:60]
    with serving(teachers, path, mechanism=noisy) as (_, address), AggregatorClient(address) as client:
        first = client.label(x)
        spent = client.budget()["epsilon_spent"]
    with serving(teachers, path, mechanism=noisy) as (_, address), AggregatorClient(address) as client:
        again = client.label(x[::-1])[::-1]
        after = client.budget()
        assert (again == first).all()
        # The distinct-input counters are restored from the ledger's answers: 60, not 0.
        assert after["epsilon_spent"] == spent and after["cache_hits"] == 60 and after["queries_answered"] == 60
        assert len(client.label(public[100:101])) == 1 and client.budget()["epsilon_spent"] > spent


class SlowTeachers:
    """Votes after a pause: keeps label threads busy so admission control shows."""

    neighbouring, neighbouring_lemma = Neighbouring.ADD_REMOVE, "one teacher per record"
    votes_per_query, batch_coupled, num_classes, local = 3, False, 10, False

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        time.sleep(1.0)
        histogram = np.zeros((len(inputs), 10), dtype=np.int64)
        histogram[:, 0] = 3
        return histogram

    def ready(self, timeout: float = 2.0) -> bool:
        return True


class PartialTeachers(SlowTeachers):
    """Histograms counting fewer votes than there are teachers (one actor's share missing)."""

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        histogram = np.zeros((len(inputs), 10), dtype=np.int64)
        histogram[:, 0] = 2
        return histogram


def test_label_calls_beyond_the_limit_are_unavailable_at_once(public, tmp_path):
    with serving(SlowTeachers(), tmp_path / "ledger.sqlite", label_workers=1, max_queued=1) as (_, address), \
            AggregatorClient(address) as client:
        with ThreadPoolExecutor(4) as pool:
            calls = [pool.submit(client.label, public[i : i + 1]) for i in range(4)]
            outcomes = [call.exception() for call in calls]
        refused = [e for e in outcomes if e is not None]
        assert 1 <= len(refused) <= 2 and all(e.code() == grpc.StatusCode.UNAVAILABLE for e in refused)
        assert client.budget()["queries_answered"] == 4 - len(refused)


def test_a_partial_ensemble_never_answers(public, tmp_path):
    with serving(PartialTeachers(), tmp_path / "ledger.sqlite") as (_, address), AggregatorClient(address) as client:
        error = rpc_error(lambda: client.label(public[:3]))
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "not every teacher voted" in error.details()
        assert client.budget()["epsilon_spent"] == 0


def test_bearer_scheme_is_case_insensitive_and_the_token_is_not(teachers, public, tmp_path):
    with serving(teachers, tmp_path / "ledger.sqlite", token="s3cret") as (_, address), \
            grpc.insecure_channel(address) as channel:
        stub = aggregator_pb2_grpc.AggregatorStub(channel)
        for scheme in ("Bearer", "bearer", "BEARER"):
            stub.GetBudget(aggregator_pb2.BudgetRequest(), metadata=(("authorization", f"{scheme} s3cret"),))
        for value in ("Bearer S3CRET", "Basic s3cret", "s3cret", "Bearer"):
            error = rpc_error(lambda: stub.GetBudget(aggregator_pb2.BudgetRequest(),
                                                     metadata=(("authorization", value),)))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_tls_and_mutual_tls(teachers, public, tmp_path):
    certs = make_certificates(tmp_path / "certs")
    with pytest.raises(ValueError, match="TLS"):
        ServerSettings(host="0.0.0.0")  # the token would cross the network in clear
    ServerSettings(host="0.0.0.0", allow_plaintext=True)  # said explicitly: allowed
    with serving(teachers, tmp_path / "a.sqlite", token="t", tls_cert=str(certs.server_cert),
                 tls_key=str(certs.server_key)) as (_, address):
        with AggregatorClient(address, token="t", root_cert=certs.ca, timeout=5) as client:
            assert client.label(public[:3]).shape == (3,)
        with AggregatorClient(address, token="t", timeout=5) as plaintext:
            assert rpc_error(plaintext.budget).code() == grpc.StatusCode.UNAVAILABLE
    with serving(teachers, tmp_path / "b.sqlite", tls_cert=str(certs.server_cert), tls_key=str(certs.server_key),
                 tls_client_ca=str(certs.ca)) as (_, address):
        with AggregatorClient(address, root_cert=certs.ca, client_cert=certs.client_cert,
                              client_key=certs.client_key, timeout=5) as client:
            assert client.label(public[:3]).shape == (3,)
        with AggregatorClient(address, root_cert=certs.ca, timeout=5) as anonymous:
            assert rpc_error(anonymous.budget).code() == grpc.StatusCode.UNAVAILABLE


def test_a_killed_teacher_turns_health_not_serving_then_recovers_without_retraining(ray_session, public, tmp_path,
                                                                                  trained_teachers):
    # The session's trained teachers (the same source, seeds and network) saved where this pool
    # keeps its checkpoints: what its actors reload from when they start, and again after the kill.
    (tmp_path / "checkpoints").mkdir()
    for saved in trained_teachers.glob("teacher-*.pt"):
        shutil.copy(saved, tmp_path / "checkpoints")
    source = TeacherSource("digits", None, public_size=100, num_teachers=4, seed=0)
    pool = TeacherPool.of_source(source, 4, "digits_cnn", TrainConfig(epochs=1, batch_size=32, lr=1e-2), num_actors=2,
                       seed=0, num_cpus_per_actor=0.25, checkpoint_dir=str(tmp_path / "checkpoints"))
    try:
        pool.train(progress=False)
        with serving(pool, tmp_path / "ledger.sqlite", health_interval=0.3) as (server, address), \
                AggregatorClient(address, timeout=20) as client, grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            before = client.label(public[:8])
            victim = pool.roster.actors[0]
            os.kill(ray.get(victim.__ray_call__.remote(lambda group: os.getpid())), signal.SIGKILL)
            wait_for(lambda: health.Check(health_pb2.HealthCheckRequest()).status == NOT_SERVING, 20, every=0.05)
            wait_for(lambda: health.Check(health_pb2.HealthCheckRequest()).status == SERVING, 60)
            # the restarted actor reloaded its teachers: no train call was made, yet all can vote
            assert pool.ready()
            fresh = client.label(public[50:58])
            assert fresh.shape == (8,) and (client.label(public[:8]) == before).all()
            votes, _ = server.answered_votes()
            assert (votes.sum(axis=1) == 4).all()  # every answer counted all four teachers
    finally:
        pool.shutdown()
    assert not any((tmp_path / "checkpoints").glob("*.pt"))  # shutdown deletes the saved models
