"""What no client can take from the others: health and reflection answer through any number of
open streams, a hung teacher fails the call fast with nothing charged, and a failing disk
does not flood the log.

Real servers on 127.0.0.1 (and ::1, a second client address), real gRPC clients, real teacher
actors stopped with SIGSTOP, a real ledger that runs out of room; bounded in count and time.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conclave.actors.aggregator import _peer_address, _StreamSlots
from conclave.actors.labeller import RateLimitedLog
from conclave.cluster.client import AggregatorClient
from conclave.privacy.accounting.charge import ADD_REMOVE
from conclave.protos import aggregator_pb2, aggregator_pb2_grpc
from tests.aggregators import INPUT_SHAPE, serving, wait_for

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
CHECK = health_pb2.HealthCheckRequest()


class InstantTeachers:
    """Three teachers that vote at once."""

    neighbouring, neighbouring_lemma, num_teachers = ADD_REMOVE, "one teacher per record", 3

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        histogram = np.zeros((len(inputs), 10), dtype=np.int64)
        histogram[:, 0] = 3
        return histogram

    def ready(self, timeout: float = 2.0) -> bool:
        return True


def fresh_inputs(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((count, *INPUT_SHAPE), dtype=np.float32)


def first_reply(call):
    """The stream's first reply, or the RpcError that ended it."""
    try:
        return next(call)
    except grpc.RpcError as err:
        return err


def list_services(channel: grpc.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    return [service.name for reply in replies for service in reply.list_services_response.service]


# ---- item 3: health and reflection cannot be starved ----


def test_a_watch_flood_is_refused_while_health_check_and_reflection_still_answer(tmp_path):
    # Before: 32 open Watch streams made every other health check and reflection call UNAVAILABLE.
    with serving(InstantTeachers(), tmp_path / "ledger.sqlite", max_unauthenticated=4) as (_, address), \
            grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watches = [health.Watch(CHECK, timeout=30) for _ in range(12)]
        try:
            started = time.perf_counter()
            firsts = [first_reply(call) for call in watches]
            watching = [reply for reply in firsts if isinstance(reply, health_pb2.HealthCheckResponse)]
            refused = [reply for reply in firsts if isinstance(reply, grpc.RpcError)]
            # one client address holds half the limit of 4; the rest are refused at once, in one short line
            assert len(watching) == 2 and all(reply.status == SERVING for reply in watching)
            assert len(refused) == 10 and {err.code() for err in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert all(len(err.details()) < 120 and "\n" not in err.details() for err in refused)
            # short calls never queue behind the open streams
            assert [health.Check(CHECK, timeout=2).status for _ in range(50)] == [SERVING] * 50
            assert "grpc.health.v1.Health" in list_services(channel)
            with AggregatorClient(address, timeout=5) as client:
                assert client.label(fresh_inputs(2, 0)).shape == (2,)
            assert time.perf_counter() - started < 10
        finally:
            for call in watches:
                call.cancel()
        # the refused client watches again once its streams are closed
        call = health.Watch(CHECK, timeout=5)
        assert next(call).status == SERVING
        call.cancel()


def test_each_client_address_holds_half_of_the_streams_and_all_of_them_are_capped(tmp_path):
    # 127.0.0.1 and ::1 are two clients of one server bound to localhost (both families).
    with serving(InstantTeachers(), tmp_path / "ledger.sqlite", host="localhost", max_unauthenticated=3,
                 max_streams=2) as (_, address):
        port = address.rpartition(":")[2]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as four, grpc.insecure_channel(f"[::1]:{port}") as six:
            calls, closing = [], threading.Event()
            try:
                def watch(channel):
                    calls.append(health_pb2_grpc.HealthStub(channel).Watch(CHECK, timeout=30))
                    return first_reply(calls[-1])

                replies = [watch(four) for _ in range(3)]  # 2 per address (half of 3, rounded up)
                assert all(isinstance(reply, health_pb2.HealthCheckResponse) for reply in replies[:2])
                assert replies[2].code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "your address" in replies[2].details()
                assert isinstance(watch(six), health_pb2.HealthCheckResponse)  # 3 open in all: the limit
                refused = watch(six)
                assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "server's limit" in refused.details()
                # LabelStreams (limit 2, one per address): refused UNAVAILABLE, as the proto says
                def label_stream(channel):
                    request = aggregator_pb2.LabelRequest(inputs=aggregator_pb2.Tensor(
                        shape=[1, *INPUT_SHAPE], dtype="float32", data=fresh_inputs(1, len(calls)).tobytes()))

                    def requests():  # one request, then the stream stays open
                        yield request
                        closing.wait(30)

                    calls.append(aggregator_pb2_grpc.AggregatorStub(channel).LabelStream(requests(), timeout=30))
                    return first_reply(calls[-1])

                assert isinstance(label_stream(four), aggregator_pb2.LabelReply)
                assert label_stream(four).code() == grpc.StatusCode.UNAVAILABLE
                assert isinstance(label_stream(six), aggregator_pb2.LabelReply)
                for channel in (four, six):
                    assert health_pb2_grpc.HealthStub(channel).Check(CHECK, timeout=2).status == SERVING
            finally:
                closing.set()
                for call in calls:
                    call.cancel()


def test_a_watch_is_closed_after_the_idle_limit_and_the_client_watches_again(tmp_path):
    with serving(InstantTeachers(), tmp_path / "ledger.sqlite", stream_idle_timeout=0.5) as (_, address), \
            grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(2):
            started = time.perf_counter()
            call = health.Watch(CHECK, timeout=10)
            assert next(call).status == SERVING
            error = first_reply(call)
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "call again" in error.details()
            assert 0.4 < time.perf_counter() - started < 3


def test_stream_slots_count_per_address_and_in_total():
    slots = _StreamSlots(5, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert slots.per_peer == 3
    assert [slots.take("10.0.0.1") for _ in range(3)] == [None] * 3
    assert "from your address" in slots.take("10.0.0.1")
    assert slots.take("10.0.0.2") is None and slots.take("10.0.0.2") is None
    assert "this server's limit" in slots.take("10.0.0.3")
    slots.give_back("10.0.0.1")
    assert slots.take("10.0.0.3") is None
    assert _peer_address("ipv4:127.0.0.1:5050") == "127.0.0.1"
    assert _peer_address("ipv6:[::1]:5050") == "::1"
    assert _peer_address("unix:/tmp/socket") == "unix:/tmp/socket"


# ---- item 7: a hung teacher fails the call fast, nothing charged ----


def test_a_stopped_teacher_fails_calls_fast_with_unavailable_and_charges_nothing(teachers, tmp_path):
    # Before: with one teacher actor stopped, 16 of 24 calls waited out their client deadline.
    public = fresh_inputs(40, 1)
    teachers.vote_timeout_s = 1.0
    pid = ray.get(teachers._actors[0].__ray_call__.remote(lambda group: os.getpid()))
    try:
        with serving(teachers, tmp_path / "ledger.sqlite", health_interval=0.3) as (server, address), \
                AggregatorClient(address, timeout=30) as client, grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            client.label(public[:4])
            spent = server.labeller.ledger.report().epsilon_spent
            os.kill(pid, signal.SIGSTOP)
            try:
                started = time.perf_counter()
                with ThreadPoolExecutor(6) as pool:
                    outcomes = [call.exception() for call in
                                [pool.submit(client.label, public[4 + 4 * i: 8 + 4 * i]) for i in range(6)]]
                took = time.perf_counter() - started
                assert all(isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNAVAILABLE for e in outcomes)
                assert took < 6  # the vote deadline (1 s), not the client's 30 s
                assert health.Check(CHECK, timeout=2).status == NOT_SERVING
                assert server.labeller.ledger.report().epsilon_spent == spent  # nothing charged
                assert server.budget().queries_answered == 4
            finally:
                os.kill(pid, signal.SIGCONT)
            wait_for(lambda: health.Check(CHECK, timeout=2).status == SERVING, 30)
            assert client.label(public[4:8]).shape == (4,)
            assert server.labeller.ledger.report().epsilon_spent > spent
    finally:
        os.kill(pid, signal.SIGCONT)
        teachers.vote_timeout_s = type(teachers).vote_timeout_s


# ---- item 8: every failure path is rate-limited ----


def test_a_full_ledger_fails_each_call_internal_with_a_bounded_log(tmp_path, caplog):
    # Before: on a full disk each failed call logged a traceback (12,625 lines for 407 calls).
    with serving(InstantTeachers(), tmp_path / "ledger.sqlite", budget=None) as (server, address), \
            AggregatorClient(address, timeout=10) as client:
        # SQLite's own page limit: the file cannot grow, as on a full disk
        db = server.labeller.ledger._db
        db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
        inputs = fresh_inputs(200, 2)
        failures = []
        with caplog.at_level(logging.INFO, logger="conclave"):
            for i in range(200):
                try:
                    client.label(inputs[i : i + 1])
                except grpc.RpcError as err:
                    failures.append(err)
        # the pages' free room takes a few answers before the file has to grow
        assert len(failures) >= 190
        assert all(e.code() == grpc.StatusCode.INTERNAL and "see its log" in e.details() for e in failures)
        lines = [record for record in caplog.records if record.name.startswith("conclave")]
        assert 1 <= len(lines) <= 5
        assert sum(record.exc_info is not None for record in lines) == 1  # the first one's traceback only
        assert "database or disk is full" in caplog.text


def test_rate_limited_log_gives_the_first_traceback_then_counts(caplog):
    limited = RateLimitedLog(logging.getLogger("conclave.test_limits"), interval=0.2)
    with caplog.at_level(logging.INFO, logger="conclave.test_limits"):
        for _ in range(3):
            for _ in range(100):
                try:
                    raise OSError("disk full")
                except OSError as err:
                    limited("disk", "charge failed: %s", type(err).__name__, level=logging.ERROR, exc_info=err)
            time.sleep(0.25)
    records = caplog.records
    assert len(records) == 3 and [r.exc_info is not None for r in records] == [True, False, False]
    assert "(and 99 more since the last line)" in records[1].getMessage()
