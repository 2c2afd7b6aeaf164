"""The port's gatekeeper: the bearer token on the aggregator's calls, and on every streaming call
of every service a cap per method (in total and per client address) and an idle limit, so open
streams can never crowd out the work or a health check."""
from __future__ import annotations

import asyncio
import hmac
import inspect
import math
from typing import Any, AsyncIterator, Callable

import grpc

from conclave.actors.aggregator.settings import ServerSettings
from conclave.actors.labeller import RateLimitedLog


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


class Gatekeeper(grpc.aio.ServerInterceptor):
    """Calls of ``protected`` (a service's full name) need the bearer token; every streaming call
    of every service is capped per method, in total and per client address, and limited in idle
    time (or, when it sends no requests, in age), so open streams can never crowd out the work or
    a health check."""

    def __init__(self, settings: ServerSettings, rejections: RateLimitedLog, protected: str) -> None:
        self._expected = settings.token.encode() if settings.token else None
        self._protected = f"/{protected}/"
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

