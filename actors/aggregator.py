"""The teacher aggregator as a gRPC service: the labelling core (``actors.labeller``) behind
an asyncio server that idle or hostile clients cannot starve.

Open streams cost asyncio tasks, not threads; blocking work runs in bounded pools, and every
stream kind is capped in total and per client address. One meaning per status code
(docs/aggregator-api.md): RESOURCE_EXHAUSTED with ``conclave-reason: privacy-budget`` is the
budget alone; a full disk or an unwritable ledger record is UNAVAILABLE, nothing charged.
Health turns NOT_SERVING on a failed vote until the vote source is ready again.
"""
from __future__ import annotations

import asyncio
import errno
import hmac
import inspect
import ipaddress
import logging
import math
import socket
import sqlite3
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
import numpy as np
import ray
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from conclave.actors.labeller import (
    INPUT_DTYPE,
    BudgetStatus,
    InvalidInput,
    LabelOutcome,
    RateLimitedLog,
    SecureVoteSource,
    TeachersUnavailable,
    VoteSource,
    decode_inputs,
    labeller_for,
)
from conclave.learning.data.schema import InputSchema
from conclave.privacy.accounting.guarantee import Guarantee
from conclave.privacy.accounting.ledger import AnsweringLedger, BudgetExceeded, LedgerUnwritable, PrivacyLedger
from conclave.privacy.accounting.run_ledger import OwnersChargedOnly
from conclave.privacy.mechanisms.base import SecureVoteMechanism, VoteMechanism
from conclave.privacy.noise import SECURE, NoisePolicy
from conclave.protos import aggregator_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = aggregator_pb2.DESCRIPTOR.services_by_name["Aggregator"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REASON_KEY, BUDGET_REASON = "conclave-reason", "privacy-budget"  # trailing metadata of a budget refusal
STORAGE_FULL = ("the aggregator cannot write its privacy ledger (disk full): nothing was released or charged; "
                "retry later")
OWNERS_CHARGED_ONLY = ("the aggregator's privacy ledger failed after the owners' ledgers were charged (see its log): "
                       "nothing was released; the owners' ledgers were charged for it; retry later")
RECORD_UNWRITABLE = ("the aggregator cannot write its privacy ledger's record (see its log): nothing was released or "
                     "charged; retry later")


@dataclass(frozen=True)
class ServerSettings:
    """Where the aggregator listens, who may call it, and how much it takes on at once.

    ``port=0`` picks a free port (``AggregatorServer.start`` returns the bound address).
    With ``token`` set, Aggregator calls need ``authorization: Bearer <token>`` metadata.
    With ``tls_cert`` and ``tls_key`` (PEM files) the port speaks TLS; with ``tls_client_ca``
    too, clients must present a certificate that CA signed (mutual TLS). A non-loopback
    ``host`` without TLS is refused unless ``allow_plaintext`` (the token would travel in clear).
    """

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    max_batch: int = 1024
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    allow_plaintext: bool = False
    label_workers: int = 8  # threads doing label work (each may wait on the teachers)
    max_queued: int = 64  # label calls waiting for a thread; more → UNAVAILABLE
    max_streams: int = 64  # LabelStreams open at once (half per client address); more → UNAVAILABLE
    max_unauthenticated: int = 32  # health Watch streams open at once, and reflection streams (half per
    # client address); more → RESOURCE_EXHAUSTED. Unary health Check calls are never capped.
    stream_idle_timeout: float = 60.0  # seconds a stream may wait for its next request
    health_interval: float = 2.0  # seconds between checks that every teacher can vote

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key (PEM files), or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key too")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no such file {path}")
        if self.token is not None and not self.token:
            raise ValueError("token must be non-empty (or None for no authentication)")
        if not self.tls_cert and not self.allow_plaintext and not is_loopback(self.host):
            raise ValueError(f"host {self.host!r} is reachable from other machines: serve it with TLS "
                             "(tls_cert, tls_key), or allow plaintext explicitly")
        for name in ("label_workers", "max_streams", "max_unauthenticated"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.stream_idle_timeout <= 0 or self.health_interval <= 0:
            raise ValueError("stream_idle_timeout and health_interval must be positive")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback one (127.0.0.0/8, ::1), as
    the server would bind it: ``localhost``, ``127.1``, ``[::1]``. By address family, not by
    spelling; a host that does not resolve is not known to be loopback."""
    try:
        resolved = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):  # socket.gaierror; a name too long for IDNA
        return False
    addresses = [ipaddress.ip_address(address[4][0].split("%")[0]) for address in resolved]
    return bool(addresses) and all(_unmapped(address).is_loopback for address in addresses)


def _unmapped(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``::ffff:127.0.0.1`` as the IPv4 address it carries."""
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


class AggregatorServer:
    """Serve private labels for inputs of ``input_shape`` (an ``InputSchema``, or a shape that
    gets its default schema: rows [d] of finite table values, else images in [0, 1]) from
    ``vote_source`` over gRPC.

    A ``SecureVoteMechanism`` runs on rounds of the secure sum over a ``SecureVoteSource``
    (``aggregation: secure``, ``actors.labeller.SecureLabeller``): this process then never holds a
    clean vote, and an owner dropping out of a round is UNAVAILABLE like any teacher failure.

    ``noise`` is the run's noise policy (OS entropy by default). ``ready=False`` starts with
    health NOT_SERVING and Label refused with UNAVAILABLE until ``set_ready(True)`` (e.g.
    while teachers still train). ``start`` runs the server on an event loop in a thread of
    its own, so callers stay synchronous.
    """

    def __init__(
        self,
        vote_source: VoteSource | SecureVoteSource,
        mechanism: VoteMechanism | SecureVoteMechanism,
        ledger: AnsweringLedger,
        input_shape: tuple[int, ...] | InputSchema,
        settings: ServerSettings = ServerSettings(),
        noise: NoisePolicy = SECURE,
        ready: bool = True,
    ) -> None:
        if not callable(getattr(vote_source, "ready", None)):
            raise TypeError(f"vote source {type(vote_source).__name__} has no ready(timeout) method: the aggregator's "
                            "health follows it (actors.labeller.VoteSource)")
        self.labeller = labeller_for(vote_source, mechanism, ledger, noise)
        self.schema = input_shape if isinstance(input_shape, InputSchema) else InputSchema.for_shape(input_shape)
        self.input_shape = self.schema.shape
        self.settings = settings
        self._operator_ready = ready  # set_ready: e.g. False while teachers train
        self._teachers_alive = True  # the watcher's view: every teacher can vote
        self._failures = 0  # vote failures reported so far; a check begun before the last one vouches for nothing
        self._wake_watcher = threading.Event()
        self._stopped = threading.Event()
        self._service: _Service | None = None
        self._address: str | None = None

    # ---- the labelling core, in-process ----

    def label(self, inputs: np.ndarray) -> LabelOutcome:
        """Labels for validated float32 inputs [batch, *input_shape] (no gRPC involved)."""
        if not self.serving:  # inputs answered before are still served, from the record
            repeated = self.labeller.on_record(inputs)
            if repeated is not None:
                return repeated
            raise TeachersUnavailable("teachers are not ready; retry when health reports SERVING")
        try:
            return self.labeller.label(inputs)
        except TeachersUnavailable:
            self._teachers_failed()
            raise

    def guarantee(self) -> Guarantee:
        return self.labeller.guarantee()

    def budget(self) -> BudgetStatus:
        return self.labeller.budget(self.settings.max_batch)  # affordable_queries: at most one batch

    def answered_votes(self) -> tuple[np.ndarray, np.ndarray]:
        return self.labeller.answered_votes()

    # ---- readiness and health ----

    @property
    def serving(self) -> bool:
        return self._operator_ready and self._teachers_alive

    def set_ready(self, ready: bool) -> None:
        """Mark the teachers ready (health SERVING when they can vote) or not (NOT_SERVING, Label → UNAVAILABLE)."""
        self._operator_ready = ready
        self._publish_health()

    def _teachers_failed(self) -> None:
        self._failures += 1
        if self._teachers_alive:
            log.warning("teachers failed to vote: health NOT_SERVING until every teacher answers again")
        self._teachers_alive = False
        self._publish_health()
        self._wake_watcher.set()

    def _publish_health(self) -> None:
        if self._service is not None:
            self._service.set_health(self.serving)

    def _watch_teachers(self) -> None:
        """Ask the vote source whether every voter can vote; health follows the answer."""
        check = self.labeller.vote_source.ready
        interval = self.settings.health_interval
        while not self._stopped.is_set():
            woken = self._wake_watcher.wait(interval)
            self._wake_watcher.clear()
            if self._stopped.is_set():
                return
            if woken and not self._teachers_alive:
                time.sleep(min(interval, 0.5))  # a failure was just reported; let the actor restart
            failures = self._failures
            try:
                alive = bool(check(timeout=interval))
            except Exception as err:  # a broken check means we cannot vouch for the teachers
                log.warning("teacher health check failed: %s", type(err).__name__)
                alive = False
            if alive and self._failures != failures:
                # A vote failed while this check ran (e.g. a probe answered by an actor just
                # resumed, its abandoned vote still running): the next check decides.
                continue
            if alive != self._teachers_alive:
                log.warning("teachers %s", "recovered: health SERVING" if alive else "lost: health NOT_SERVING")
                self._teachers_alive = alive
                self._publish_health()

    # ---- the gRPC server ----

    def start(self) -> str:
        """Start serving; returns the bound address ``host:port``."""
        if self._service is not None:
            raise RuntimeError("aggregator already started")
        self._stopped.clear()
        self._service = _Service(self)
        try:
            port = self._service.start()
        except Exception:
            self._service = None
            raise
        self._address = f"{self.settings.host}:{port}"
        self._publish_health()
        threading.Thread(target=self._watch_teachers, name="aggregator-health", daemon=True).start()
        settings = self.settings
        log.info("aggregator serving on %s (%s, %s, mechanism %s)", self._address,
                 "mutual TLS" if settings.tls_client_ca else "TLS" if settings.tls else "plaintext",
                 "token auth" if settings.token else "no auth", self.labeller.mechanism.name)
        return self._address

    @property
    def address(self) -> str | None:
        return self._address

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving (in-flight calls get ``grace`` seconds)."""
        if self._service is None:
            return
        self._stopped.set()
        self._wake_watcher.set()
        self._service.stop(grace)
        self._service = None
        log.info("aggregator on %s stopped", self._address)


class _Service:
    """The asyncio gRPC server of one ``AggregatorServer``, on an event loop in its own thread.

    Handlers run on the loop and never block it: label work goes to ``label_pool`` (bounded
    admission), budget reads to ``budget_pool``. Counters are touched only on the loop.
    """

    def __init__(self, owner: AggregatorServer) -> None:
        self._owner = owner
        self._settings = settings = owner.settings
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="aggregator-grpc", daemon=True)
        self._label_pool = futures.ThreadPoolExecutor(settings.label_workers, thread_name_prefix="aggregator-label")
        self._budget_pool = futures.ThreadPoolExecutor(2, thread_name_prefix="aggregator-budget")
        self._label_calls = 0
        self._rejections = RateLimitedLog(log)
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        example = math.prod(owner.input_shape) * INPUT_DTYPE.itemsize
        # Twice the largest batch (plus framing): a batch somewhat over max_batch still gets a
        # clear INVALID_ARGUMENT; anything larger is refused by gRPC before it is buffered.
        self.max_message = 2 * settings.max_batch * example + (64 << 10)

    # -- lifecycle (called from the owner's thread) --

    def start(self) -> int:
        self._thread.start()
        try:
            return self._run(self._start())
        except Exception:
            self.stop(0)
            raise

    def stop(self, grace: float) -> None:
        if self._server is not None:
            self._run(self._stop(grace))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self._label_pool.shutdown(wait=False, cancel_futures=True)
        self._budget_pool.shutdown(wait=False, cancel_futures=True)

    def set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if self._health is not None and not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._set_health(status), self._loop)

    def _run(self, coroutine: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)

    # -- on the loop --

    async def _start(self) -> int:
        settings = self._settings
        server = grpc.aio.server(
            interceptors=[_Gatekeeper(settings, self._rejections)],
            options=[
                ("grpc.max_receive_message_length", self.max_message),
                ("grpc.max_send_message_length", 4 * settings.max_batch * 8 + (1 << 20)),
                ("grpc.max_concurrent_streams", 256),  # per connection (HTTP/2)
                ("grpc.keepalive_time_ms", 60_000),  # ping idle connections to find dead peers
                ("grpc.keepalive_timeout_ms", 20_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),  # refuse ping floods
                ("grpc.max_connection_idle_ms", 15 * 60_000),  # drop connections with no calls
                # gRPC sets SO_REUSEPORT by default: a second server on this port would share
                # it silently and take some of this one's clients.
                ("grpc.so_reuseport", 0),
            ],
        )
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE_NAME, {
            # request_deserializer=None: handlers get the raw bytes and parse them themselves.
            "Label": grpc.unary_unary_rpc_method_handler(
                self._label, response_serializer=aggregator_pb2.LabelReply.SerializeToString),
            "LabelStream": grpc.stream_stream_rpc_method_handler(
                self._label_stream, response_serializer=aggregator_pb2.LabelReply.SerializeToString),
            "GetBudget": grpc.unary_unary_rpc_method_handler(
                self._get_budget, response_serializer=aggregator_pb2.BudgetReply.SerializeToString),
        })])
        self._health = health.aio.HealthServicer()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING if self._owner.serving
                               else health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
        target = f"{settings.host}:{settings.port}"
        try:
            port = (server.add_secure_port(target, _credentials(settings)) if settings.tls
                    else server.add_insecure_port(target))
        except RuntimeError:  # gRPC's "Failed to bind": in use (another server holds it), or not this host's
            port = 0
        if port == 0:
            raise OSError(f"could not bind the aggregator to {target}: the address is in use or not on this host")
        await server.start()
        self._server = server
        return port

    async def _stop(self, grace: float) -> None:
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        self._server = None

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)

    async def _label(self, raw: bytes, context: grpc.aio.ServicerContext) -> aggregator_pb2.LabelReply:
        return await self._answer(raw, context, "Label")

    async def _label_stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
        # Counted and idle-limited by the _Gatekeeper, like every stream.
        async for raw in requests:
            yield await self._answer(raw, context, "LabelStream")

    async def _get_budget(self, raw: bytes, context: grpc.aio.ServicerContext) -> aggregator_pb2.BudgetReply:
        problem = _budget_request_problem(raw)
        if problem is not None:
            self._rejections("invalid", "GetBudget from %s rejected: %s", context.peer(), problem)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        status = await self._loop.run_in_executor(self._budget_pool, self._owner.budget)
        return budget_reply(status)

    async def _answer(self, raw: bytes, context: grpc.aio.ServicerContext, method: str) -> aggregator_pb2.LabelReply:
        owner, settings = self._owner, self._settings
        try:
            request = aggregator_pb2.LabelRequest.FromString(raw)
            tensor = request.inputs
            inputs = decode_inputs(tensor.shape, tensor.dtype, tensor.data, owner.schema, settings.max_batch)
        except (DecodeError, InvalidInput) as err:
            message = str(err) if isinstance(err, InvalidInput) else "the request is not a LabelRequest message"
            self._rejections("invalid", "%s from %s rejected: %s", method, context.peer(), message)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        if self._label_calls >= settings.label_workers + settings.max_queued:
            self._rejections("busy", "%s from %s turned away: %d label calls in progress", method, context.peer(),
                             self._label_calls)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the aggregator is at its limit of {self._label_calls} label calls; retry later")
        self._label_calls += 1
        try:
            # One hop to a label thread for both: each hand-off between threads costs a call latency.
            outcome, status = await self._loop.run_in_executor(self._label_pool, _label_then_budget, owner, inputs)
        except BudgetExceeded as err:
            self._rejections("budget", "%s from %s refused: privacy budget spent", method, context.peer())
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{err}; nothing was released or charged",
                                trailing_metadata=((REASON_KEY, BUDGET_REASON),))
        except TeachersUnavailable as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except OwnersChargedOnly as err:  # before the storage check: it may come from a full disk, but a charge stands
            self._rejections("storage", "%s failed: %s", method, err, level=logging.ERROR)
            await context.abort(grpc.StatusCode.UNAVAILABLE, OWNERS_CHARGED_ONLY)
        except Exception as err:  # a bug must not look like a client error, nor leak internals
            # The ledger refuses a charge it cannot write before committing it (``ledger_store``): the
            # operator frees space or mends the folder and the same call succeeds: UNAVAILABLE.
            if storage_full(err) or isinstance(err, LedgerUnwritable):
                self._rejections("storage", "%s failed: the privacy ledger cannot be written (%s)", method, err,
                                 level=logging.ERROR)
                await context.abort(grpc.StatusCode.UNAVAILABLE, STORAGE_FULL if storage_full(err) else
                                    RECORD_UNWRITABLE)
            self._rejections("internal", "%s failed: %s", method, type(err).__name__, level=logging.ERROR,
                             exc_info=err)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error in the aggregator (see its log)")
        finally:
            self._label_calls -= 1
        return aggregator_pb2.LabelReply(labels=outcome.labels.tolist(), answered=outcome.answered,
                                         budget=budget_reply(status),
                                         budget_refused=outcome.refused.tolist() if outcome.refused.any() else [])


def storage_full(err: BaseException) -> bool:
    """Whether ``err``, or an error it came from, is a full disk (or quota): SQLite's
    SQLITE_FULL, or ENOSPC / EDQUOT from the OS — also inside a Ray task's error, as when an
    owner's ledger on its node cannot be written."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [err]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, sqlite3.Error) and getattr(current, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return True
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        pending += [getattr(current, "cause", None), current.__cause__, current.__context__]
    return False


def _budget_request_problem(raw: bytes) -> str | None:
    """Why ``raw`` is not a ``BudgetRequest`` (an empty message: any field in it is one this
    server does not have), or None."""
    try:
        request = aggregator_pb2.BudgetRequest.FromString(raw)
    except DecodeError:
        return "the request is not a BudgetRequest message"
    if request.ByteSize():
        return f"a BudgetRequest has no fields; this one carries {request.ByteSize()} bytes of them"
    return None


def _label_then_budget(owner: AggregatorServer, inputs: np.ndarray) -> tuple[LabelOutcome, BudgetStatus]:
    return owner.label(inputs), owner.budget()


def budget_reply(status: BudgetStatus) -> aggregator_pb2.BudgetReply:
    """The ``BudgetReply`` message of a ``BudgetStatus``."""
    fields = status.as_dict()
    return aggregator_pb2.BudgetReply(**{**fields, "guarantee": aggregator_pb2.Guarantee(**fields["guarantee"])})


def _credentials(settings: ServerSettings) -> grpc.ServerCredentials:
    pairs = [(Path(settings.tls_key).read_bytes(), Path(settings.tls_cert).read_bytes())]
    if settings.tls_client_ca is None:
        return grpc.ssl_server_credentials(pairs)
    return grpc.ssl_server_credentials(pairs, root_certificates=Path(settings.tls_client_ca).read_bytes(),
                                       require_client_auth=True)


async def _idle_limited(requests: AsyncIterator[Any], timeout: float, context: grpc.aio.ServicerContext):
    """The stream's requests, ending the call with DEADLINE_EXCEEDED when none comes for ``timeout`` s."""
    iterator = requests.__aiter__()
    while True:
        try:
            request = await asyncio.wait_for(iterator.__anext__(), timeout)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no request for {timeout:g} s: this stream is closed, open a new one")
        yield request


class _StreamSlots:
    """The long-lived calls of one method open now, in total and per client address; only
    touched on the event loop."""

    def __init__(self, total: int, refusal: grpc.StatusCode) -> None:
        self.total = total
        self.per_peer = max(1, math.ceil(total / 2))  # one address never holds them all
        self.refusal = refusal
        self._open = 0
        self._by_peer: dict[str, int] = {}

    def take(self, peer: str) -> str | None:
        """Take a slot for ``peer`` (an address); the refusal message when none is free."""
        mine = self._by_peer.get(peer, 0)
        if mine >= self.per_peer:
            return f"{mine} of these streams are open from your address, its limit; close one or retry later"
        if self._open >= self.total:
            return f"{self._open} of these streams are open, this server's limit; retry later"
        self._open += 1
        self._by_peer[peer] = mine + 1
        return None

    def give_back(self, peer: str) -> None:
        self._open -= 1
        left = self._by_peer.pop(peer) - 1
        if left:
            self._by_peer[peer] = left


def _peer_address(peer: str) -> str:
    """The client's address in gRPC's peer string, without its port (``ipv4:127.0.0.1:5050``,
    ``ipv6:[::1]:5050``): what a per-client limit counts."""
    family, _, rest = peer.partition(":")
    if family == "ipv4":
        return rest.rpartition(":")[0]
    if family == "ipv6":
        return rest.rpartition("]")[0].lstrip("[")
    return peer  # unix sockets: every client is this host


class _Gatekeeper(grpc.aio.ServerInterceptor):
    """Aggregator calls need the bearer token; every streaming call of every service is capped
    per method, in total and per client address, and limited in idle time (or, when it sends
    no requests, in age), so open streams can never crowd out the work or a health check."""

    def __init__(self, settings: ServerSettings, rejections: RateLimitedLog) -> None:
        self._expected = settings.token.encode() if settings.token else None
        self._protected = f"/{SERVICE_NAME}/"
        self._settings = settings
        self._rejections = rejections
        self._slots: dict[str, _StreamSlots] = {}  # by method

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        protected = details.method.startswith(self._protected)
        if protected:
            problem = self._token_problem(details.invocation_metadata or ())
            if problem is not None:
                return _replaced(handler, _refuse(grpc.StatusCode.UNAUTHENTICATED, problem))
        if not (handler.request_streaming or handler.response_streaming):
            return handler  # short: never refused for the streams others hold open
        return _replaced(handler, self._bounded(details.method, protected, handler))

    def _token_problem(self, metadata) -> str | None:
        if self._expected is None:
            return None
        supplied = [value for key, value in metadata if key == "authorization"]
        if not supplied:
            return "missing 'authorization: Bearer <token>' metadata"
        value = supplied[0] if isinstance(supplied[0], bytes) else supplied[0].encode()
        scheme, _, token = value.partition(b" ")
        # compare_digest on the token alone: constant time in its content
        if len(supplied) == 1 and scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._expected):
            return None
        return "invalid bearer token"

    def _slots_for(self, method: str, protected: bool) -> _StreamSlots:
        if method not in self._slots:
            settings = self._settings
            # LabelStream's limit is UNAVAILABLE, as the proto says; the open services' RESOURCE_EXHAUSTED.
            self._slots[method] = (_StreamSlots(settings.max_streams, grpc.StatusCode.UNAVAILABLE) if protected
                                   else _StreamSlots(settings.max_unauthenticated, grpc.StatusCode.RESOURCE_EXHAUSTED))
        return self._slots[method]

    def _bounded(self, method: str, protected: bool, handler: grpc.RpcMethodHandler) -> Callable:
        slots, behaviour = self._slots_for(method, protected), _behaviour(handler)
        timeout, request_streaming = self._settings.stream_idle_timeout, handler.request_streaming

        async def bounded(request_or_iterator, context):
            peer = _peer_address(context.peer())
            refused = slots.take(peer)
            if refused is not None:
                self._rejections("streams", "%s from %s refused: %s", method, context.peer(), refused)
                await context.abort(slots.refusal, refused)
            try:
                if request_streaming:
                    return await _run(behaviour, _idle_limited(request_or_iterator, timeout, context), context)
                try:  # no requests to be idle between (health Watch): its age is limited instead
                    async with asyncio.timeout(timeout):
                        return await _run(behaviour, request_or_iterator, context)
                except TimeoutError:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"open for {timeout:g} s: this stream is closed, call again")
            finally:
                slots.give_back(peer)

        return bounded


async def _run(behaviour: Callable, request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
    """Run a handler's behaviour to its end, whichever way it was written."""
    result = behaviour(request_or_iterator, context)
    if inspect.isasyncgen(result):  # a streaming handler written as a generator
        async for reply in result:
            await context.write(reply)
        return None
    return await result if inspect.isawaitable(result) else result


def _behaviour(handler: grpc.RpcMethodHandler) -> Callable:
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream


def _refuse(code: grpc.StatusCode, message: str) -> Callable:
    async def refuse(request_or_iterator, context):
        await context.abort(code, message)

    return refuse


def _replaced(handler: grpc.RpcMethodHandler, behaviour: Callable) -> grpc.RpcMethodHandler:
    """A handler of the same kind and (de)serializers as ``handler`` running ``behaviour``."""
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(behaviour, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


@ray.remote(num_cpus=0)
class AggregatorActor:
    """``AggregatorServer`` inside a Ray actor (it uses no CPU slot: teachers do the work).

    The ledger is opened inside the actor from its path (an SQLite handle cannot travel),
    with the budget the caller declared.
    """

    def __init__(self, vote_source: VoteSource | SecureVoteSource, mechanism: VoteMechanism | SecureVoteMechanism,
                 ledger_path: str, delta: float, budget,
                 input_shape: tuple[int, ...] | InputSchema, settings: ServerSettings = ServerSettings(),
                 noise: NoisePolicy = SECURE, ready: bool = True) -> None:
        self._ledger = PrivacyLedger(ledger_path, delta, budget, neighbouring=vote_source.neighbouring)
        self._server = AggregatorServer(vote_source, mechanism, self._ledger, input_shape, settings,
                                        noise=noise, ready=ready)

    def start(self) -> str:
        return self._server.start()

    def stop(self) -> None:
        self._server.stop()
        self._ledger.close()

    def set_ready(self, ready: bool) -> None:
        self._server.set_ready(ready)

    def budget(self) -> dict:
        return self._server.budget().as_dict()

    def answered_votes(self) -> tuple[np.ndarray, np.ndarray]:
        return self._server.answered_votes()
