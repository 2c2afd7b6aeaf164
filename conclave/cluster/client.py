"""A small Python client for the aggregator's gRPC service.

    with AggregatorClient("127.0.0.1:50051", token="...") as client:
        labels = client.label(images)          # int64, -1 where the teachers abstained
        print(client.budget()["guarantee"]["epsilon"])   # what may be published

Server-side failures raise ``grpc.RpcError``; ``err.code()`` tells them apart:
INVALID_ARGUMENT (bad inputs), UNAUTHENTICATED (token), RESOURCE_EXHAUSTED (the privacy budget
pays for none of the batch: nothing was released or charged — ``is_budget_refusal(err)`` checks
the server's reason too; a batch it pays for in part is answered, the rest marked ``refused``),
UNAVAILABLE (teachers not ready or past their deadline, an owner missing a secure round's, the
server's disk full, or the server busy: retry later), DEADLINE_EXCEEDED (the call's deadline —
the server's own deadlines are below the default 30 s, so a hung owner is UNAVAILABLE — or a
stream left idle too long).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

import grpc
import numpy as np

from conclave.errors import InvalidValue
from conclave.protos import BUDGET_REASON, REASON_KEY, aggregator_pb2, aggregator_pb2_grpc

log = logging.getLogger(__name__)


def is_budget_refusal(err: BaseException) -> bool:
    """True when ``err`` is the aggregator saying the privacy budget is spent (nothing was
    released or charged) — not any other RESOURCE_EXHAUSTED, such as gRPC's own message size limit."""
    if not isinstance(err, grpc.RpcError) or not hasattr(err, "code") or err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    trailing = err.trailing_metadata() or ()
    return any(key == REASON_KEY and value == BUDGET_REASON for key, value in trailing)


class LabelResult(NamedTuple):
    """One batch's answer: labels (int64, -1 = abstain or refused), how many are labels, which
    new inputs the budget refused (beyond what it pays; asking again later may find room), the
    budget after it."""

    labels: np.ndarray
    answered: int
    refused: np.ndarray
    budget: dict


def encode_inputs(inputs: np.ndarray) -> aggregator_pb2.Tensor:
    """A float32 ``Tensor`` for a batch; floating arrays are cast, anything else is refused."""
    array = np.asarray(inputs)
    if not np.issubdtype(array.dtype, np.floating):
        raise TypeError(f"inputs must be floating point (scaled like the training data), got {array.dtype}")
    array = np.ascontiguousarray(array, dtype="<f4")
    return aggregator_pb2.Tensor(shape=list(array.shape), dtype="float32", data=array.tobytes())


class AggregatorClient:
    """Talk to one aggregator; plaintext unless ``root_cert`` (PEM path or bytes) is given,
    with a client certificate (``client_cert``, ``client_key``) for mutual TLS.

    ``retry_unavailable``: for this many seconds, a ``Label`` answered UNAVAILABLE (teachers
    restarting, server busy; nothing was charged) is asked again with backoff; 0 raises at once.
    """

    is_budget_refusal = staticmethod(is_budget_refusal)  # for callers handed only a client

    def __init__(
        self,
        address: str,
        token: str | None = None,
        root_cert: str | Path | bytes | None = None,
        timeout: float = 30.0,
        client_cert: str | Path | bytes | None = None,
        client_key: str | Path | bytes | None = None,
        retry_unavailable: float = 0.0,
    ) -> None:
        if (client_cert is None) != (client_key is None):
            raise InvalidValue("mutual TLS needs both client_cert and client_key")
        if client_cert is not None and root_cert is None:
            raise InvalidValue("a client certificate needs TLS: give root_cert too")
        self.address = address
        self.timeout = timeout
        self.retry_unavailable = retry_unavailable
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
                   # gRPC's default reconnect backoff grows to 2 minutes: a client would go on
                   # failing fast long after a restarted server is back.
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
        if root_cert is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates=_pem(root_cert), private_key=_pem(client_key),
                                                       certificate_chain=_pem(client_cert))
            self._channel = grpc.secure_channel(address, credentials, options)
        else:
            self._channel = grpc.insecure_channel(address, options)
        self._stub = aggregator_pb2_grpc.AggregatorStub(self._channel)

    def label(self, inputs: np.ndarray) -> np.ndarray:
        """Labels for one batch [batch, *input_shape]: int64, -1 = abstain (or refused)."""
        return self.label_reply(inputs).labels

    def label_reply(self, inputs: np.ndarray) -> LabelResult:
        """The whole answer for one batch (labels, answered count, refused mask, budget after it)."""
        request = aggregator_pb2.LabelRequest(inputs=encode_inputs(inputs))
        deadline, pause = time.monotonic() + self.retry_unavailable, 0.2
        while True:
            try:
                return _result(self._stub.Label(request, timeout=self.timeout, metadata=self._metadata))
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + pause > deadline:
                    raise
                log.info("aggregator unavailable (%s); asking again in %.1f s", err.details(), pause)
                time.sleep(pause)
                pause = min(2 * pause, 5.0)

    def label_stream(self, batches: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        """Labels for each batch, in order, over one bidirectional stream.

        The stream has no overall deadline (it may run for many batches). An error (e.g. RESOURCE_EXHAUSTED) ends the
        stream; batches answered before it were already yielded (and are cached server-side,
        so asking again costs nothing).
        """
        for result in self.label_stream_replies(batches):
            yield result.labels

    def label_stream_replies(self, batches: Iterable[np.ndarray]) -> Iterator[LabelResult]:
        """``label_stream`` with the whole answer for each batch."""
        requests = (aggregator_pb2.LabelRequest(inputs=encode_inputs(batch)) for batch in batches)
        for reply in self._stub.LabelStream(requests, metadata=self._metadata):
            yield _result(reply)

    def budget(self) -> dict:
        """The server's privacy budget and query counters (``BudgetReply`` fields); ``affordable_queries``
        is how many new inputs a batch may hold now with none refused (0: the budget is spent)."""
        reply = self._stub.GetBudget(aggregator_pb2.BudgetRequest(), timeout=self.timeout, metadata=self._metadata)
        return _budget_dict(reply)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AggregatorClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _pem(value: str | Path | bytes | None) -> bytes | None:
    return value if value is None or isinstance(value, bytes) else Path(value).read_bytes()


def _result(reply: aggregator_pb2.LabelReply) -> LabelResult:
    labels = np.asarray(reply.labels, dtype=np.int64)
    refused = np.zeros(len(labels), dtype=bool)
    if reply.budget_refused:
        refused[:] = np.asarray(reply.budget_refused, dtype=bool)
    return LabelResult(labels, int(reply.answered), refused, _budget_dict(reply.budget))


def _budget_dict(reply: aggregator_pb2.BudgetReply) -> dict:
    """The reply as a dict; ``guarantee`` is a nested dict (what may be published)."""
    budget = {field.name: getattr(reply, field.name) for field in aggregator_pb2.BudgetReply.DESCRIPTOR.fields}
    guarantee = reply.guarantee
    budget["guarantee"] = {field.name: getattr(guarantee, field.name)
                           for field in aggregator_pb2.Guarantee.DESCRIPTOR.fields}
    budget["guarantee"]["unsound_reasons"] = list(guarantee.unsound_reasons)
    return budget
