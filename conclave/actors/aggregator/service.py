"""The aggregator's asyncio gRPC server: Label, LabelStream and GetBudget, the standard health
service and reflection, on an event loop in a thread of its own.

Open streams cost asyncio tasks, not threads; blocking work runs in bounded pools (label calls
past the queue are UNAVAILABLE), and the ``Gatekeeper`` caps and idle-limits every stream.
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
from concurrent import futures
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Protocol

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from conclave.actors.aggregator.gatekeeper import Gatekeeper
from conclave.actors.aggregator.refusals import storage_refusal
from conclave.actors.aggregator.settings import ServerSettings
from conclave.actors.labeller import (
    INPUT_DTYPE, BudgetStatus, InvalidInput, LabelOutcome, RateLimitedLog, TeachersUnavailable, decode_inputs,
)
from conclave.learning.data.schema import InputSchema
from conclave.privacy.accounting.ledger import BudgetExceeded
from conclave.protos import BUDGET_REASON, REASON_KEY, aggregator_pb2

log = logging.getLogger(__package__)  # the aggregator's one log, whichever of its parts writes

SERVICE_NAME = aggregator_pb2.DESCRIPTOR.services_by_name["Aggregator"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class Answering(Protocol):
    """What the service answers from (``AggregatorServer``)."""

    settings: ServerSettings
    schema: InputSchema
    input_shape: tuple[int, ...]

    @property
    def serving(self) -> bool: ...

    def label(self, inputs: np.ndarray) -> LabelOutcome: ...

    def budget(self) -> BudgetStatus: ...


class AggregatorService:
    """The asyncio gRPC server of one ``AggregatorServer`` (``owner``), on an event loop in its own thread.

    Handlers run on the loop and never block it: label work goes to ``label_pool`` (bounded
    admission), budget reads to ``budget_pool``. Counters are touched only on the loop.
    """

    def __init__(self, owner: Answering) -> None:
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
            interceptors=[Gatekeeper(settings, self._rejections, SERVICE_NAME)],
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
        except Exception as err:  # a bug must not look like a client error, nor leak internals
            refusal = storage_refusal(err)
            if refusal is not None:  # the operator frees space or mends the folder; the same call succeeds
                self._rejections("storage", "%s failed: the privacy ledger cannot be written (%s)", method, err,
                                 level=logging.ERROR)
                await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
            self._rejections("internal", "%s failed: %s", method, type(err).__name__, level=logging.ERROR,
                             exc_info=err)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error in the aggregator (see its log)")
        finally:
            self._label_calls -= 1
        return aggregator_pb2.LabelReply(labels=outcome.labels.tolist(), answered=outcome.answered,
                                         budget=budget_reply(status),
                                         budget_refused=outcome.refused.tolist() if outcome.refused.any() else [])



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


def _label_then_budget(owner: Answering, inputs: np.ndarray) -> tuple[LabelOutcome, BudgetStatus]:
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

