"""What no client can take from the others: health and reflection answer through any number of
open streams, a hung teacher fails the call fast with nothing charged, a failing disk
does not flood the log, and a ledger record that cannot be written charges nothing unanswered.

Real servers on 127.0.0.1 (and ::1, a second client address), real gRPC clients, real teacher
actors stopped with SIGSTOP, a real ledger on a real file system that runs out of room;
bounded in count and time.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import grpc
import numpy as np
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conclave.actors.aggregator import RECORD_UNWRITABLE, STORAGE_FULL, AggregatorServer, ServerSettings, storage_full
from conclave.actors.aggregator.gatekeeper import _peer_address, _StreamSlots
from conclave.actors.labeller import RateLimitedLog
from conclave.cluster.client import AggregatorClient
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.mechanisms import build_mechanism
from conclave.protos import aggregator_pb2, aggregator_pb2_grpc
from tests.aggregators import DELTA, INPUT_SHAPE, budget_for, serving, wait_for

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
CHECK = health_pb2.HealthCheckRequest()


class InstantTeachers:
    """Three teachers that vote at once."""

    neighbouring, neighbouring_lemma = Neighbouring.ADD_REMOVE, "one teacher per record"
    votes_per_query, batch_coupled, num_classes, local = 3, False, 10, False

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
            assert time.perf_counter() - started < 30
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
            assert 0.4 < time.perf_counter() - started < 8  # the 0.5 s idle limit, not the call's 10 s


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
    pid = ray.get(teachers.roster.actors[0].__ray_call__.remote(lambda group: os.getpid()))
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
                assert took < 20  # the vote deadline (1 s), not the client's 30 s (room for a loaded machine)
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


# An aggregator in a process of its own whose ledger lies on a small tmpfs, mounted in a private
# mount namespace (``unshare``): a real file system that refuses writes with ENOSPC once full, and
# nothing mounted where other processes see it. It serves until its stdin closes.
ON_SMALL_DISK = """
import logging, sys
from pathlib import Path
from tests.actors.test_aggregator_limits import InstantTeachers
from tests.aggregators import serving
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
with serving(InstantTeachers(), Path(sys.argv[1]) / "ledger.sqlite", budget=None) as (_, address):
    print(address, flush=True)
    sys.stdin.read()
"""
ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def aggregator_on_a_small_disk(size: str) -> Iterator[tuple[str, Path, subprocess.Popen]]:
    """(address, the tmpfs folder as this process reaches it, the server process)."""
    if sys.platform != "linux" or shutil.which("unshare") is None:
        pytest.fail("the full-disk test needs Linux and unshare for a private tmpfs")
    flags = ["--mount"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--mount"]
    folder = "/mnt"  # inside the namespace only
    server = subprocess.Popen(
        ["unshare", *flags, "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs -o size={size} conclave-test {folder} && exec "$0" "$@"',
         sys.executable, "-c", ON_SMALL_DISK, folder],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().strip()
        if not address:
            server.kill()
            pytest.fail(f"no private tmpfs here: {server.stderr.read().strip()[-300:]}")
        # Through the server's root (unshare execs: the PID is the server's). Not for SQLite, which
        # would resolve the link to this process's own /mnt.
        yield address, Path(f"/proc/{server.pid}/root{folder}"), server
    finally:
        if server.poll() is None:
            server.stdin.close()
            server.wait(timeout=30)


def fill(disk: Path) -> int:
    """Write a file on ``disk`` until the file system refuses (ENOSPC); its size."""
    written = 0
    with open(disk / "filler", "wb", buffering=0) as filler:
        try:
            while True:
                written += filler.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC
    return written


def test_a_full_disk_under_the_ledger_fails_each_call_unavailable_with_a_bounded_log():
    # Before: INTERNAL, a code outside the documented table (and, earlier, a traceback per call:
    # 12,625 lines for 407 calls). Now UNAVAILABLE: nothing was charged, and once the operator frees
    # space the same call is answered.
    inputs = fresh_inputs(121, 2)
    with aggregator_on_a_small_disk("1m") as (address, disk, server), AggregatorClient(address, timeout=10) as client:
        assert client.label(inputs[:1]).shape == (1,)
        assert fill(disk) > 0
        before = client.budget()
        failures, answered = [], 0
        for i in range(1, 120):
            try:
                client.label(inputs[i : i + 1])
                answered += 1
            except grpc.RpcError as err:
                failures.append(err)
        # the file system's last partial page may take an answer or two before it fails
        assert len(failures) >= 115 and answered <= 4
        assert all(e.code() == grpc.StatusCode.UNAVAILABLE and e.details() == STORAGE_FULL for e in failures)
        after = client.budget()
        assert after["queries_answered"] + after["queries_abstained"] == 1 + answered
        assert answered or after["epsilon_spent"] == before["epsilon_spent"]  # the refused: nothing charged
        assert client.label(inputs[:1]).shape == (1,)  # on record: answered from it, free
        (disk / "filler").unlink()
        assert client.label(inputs[120:121]).shape == (1,)  # room again: the same kind of call is answered
        server.stdin.close()
        log = server.stderr.read()
    lines = [line for line in log.splitlines() if line.startswith("conclave.actors.aggregator: Label failed")]
    assert 1 <= len(lines) <= 5 and "database or disk is full" in lines[0]
    assert "Traceback" not in log  # a full disk is no bug: no traceback


@contextlib.contextmanager
def serving_a_kept_ledger(path: Path) -> Iterator[tuple[AggregatorServer, str]]:
    """A server over a ledger that keeps its record outside the file, as ``conclave serve``'s does."""
    mechanism = build_mechanism("gnmax", sigma=2.0)
    ledger = PrivacyLedger(path, DELTA, budget_for(mechanism, 50.0), keep_record=True)
    server = AggregatorServer(InstantTeachers(), mechanism, ledger, INPUT_SHAPE, ServerSettings())
    try:
        yield server, server.start()
    finally:
        server.stop()
        ledger.close()


def test_a_ledger_record_that_cannot_be_written_refuses_calls_with_nothing_charged(tmp_path, monkeypatch):
    # Before: each call was charged, then told UNAVAILABLE "nothing was released or charged", and its
    # answers were dropped: asked again, it was charged again, with fresh noise (another label).
    monkeypatch.setenv("CONCLAVE_HOME", str(tmp_path / "home"))
    records, inputs = tmp_path / "home" / "ledgers", fresh_inputs(6, 3)
    with serving_a_kept_ledger(tmp_path / "ledger.sqlite") as (server, address), \
            AggregatorClient(address, timeout=10) as client:
        labels = client.label(inputs[:1])
        charges = server.labeller.ledger.report().charges
        saved = {record.name: record.read_bytes() for record in records.iterdir()}
        for record in records.iterdir():
            record.unlink()
        records.rmdir()
        records.write_text("a file where the records' folder should be")
        for i in range(1, 6):
            with pytest.raises(grpc.RpcError) as refused:
                client.label(inputs[i:i + 1])
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and refused.value.details() == RECORD_UNWRITABLE
        assert server.labeller.ledger.report().charges == charges  # nothing was charged, as the clients were told
        assert (client.label(inputs[:1]) == labels).all()  # on record: answered from it, free
        records.unlink()
        records.mkdir()
        for name, data in saved.items():
            (records / name).write_bytes(data)
        answered = [client.label(inputs[i:i + 1]) for i in range(1, 6)]
        assert server.labeller.ledger.report().charges == charges + 5  # once each
        assert all((client.label(inputs[i:i + 1]) == answered[i - 1]).all() for i in range(1, 6))  # repeats: free
        assert server.labeller.ledger.report().charges == charges + 5


def test_a_charge_whose_record_is_not_put_in_place_answers_and_the_next_is_refused(tmp_path, monkeypatch):
    # The record's rename after the commit fails (a folder in its place): the call was charged, so it is
    # answered, and its answers are kept; the next new input is refused, nothing charged, until the record is mended.
    monkeypatch.setenv("CONCLAVE_HOME", str(tmp_path / "home"))
    inputs = fresh_inputs(3, 4)
    with serving_a_kept_ledger(tmp_path / "ledger.sqlite") as (server, address), \
            AggregatorClient(address, timeout=10) as client:
        (record,) = (tmp_path / "home" / "ledgers").glob("*.json")
        record.unlink()
        record.mkdir()
        labels = client.label(inputs[:2])
        charges = server.labeller.ledger.report().charges
        assert (client.label(inputs[:2]) == labels).all() and server.labeller.ledger.report().charges == charges
        with pytest.raises(grpc.RpcError) as refused:
            client.label(inputs[2:])
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and refused.value.details() == RECORD_UNWRITABLE
        assert server.labeller.ledger.report().charges == charges
        record.rmdir()
        client.label(inputs[2:])
        assert server.labeller.ledger.report().charges == charges + 1


def test_a_full_disk_is_recognised_through_the_errors_that_carry_it():
    assert storage_full(_sqlite_full())
    try:  # e.g. an owner's ledger on its node, reached through another error
        raise RuntimeError("owner ledger") from OSError(errno.ENOSPC, "No space left on device")
    except RuntimeError as err:
        assert storage_full(err)
    assert not storage_full(RuntimeError("charge failed"))
    assert not storage_full(OSError(errno.EACCES, "Permission denied"))


def _sqlite_full() -> sqlite3.Error:
    """The error SQLite raises when its file cannot grow (SQLITE_FULL, as on a full disk)."""
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (x BLOB)")
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
    try:
        db.execute("INSERT INTO t VALUES (zeroblob(100000))")
    except sqlite3.OperationalError as err:
        return err
    raise AssertionError("SQLite took a row past its page limit")


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
