"""A small Python client for the aggregator's gRPC service.

    with AggregatorClient("127.0.0.1:50051", token="...") as client:
        labels = client.label(images)          # int64, -1 where the teachers abstained
        print(client.budget()["guarantee"]["epsilon"])   # what may be published

Server-side failures raise ``grpc.RpcError``; ``err.code()`` tells them apart:
INVALID_ARGUMENT (bad inputs), UNAUTHENTICATED (token), RESOURCE_EXHAUSTED (privacy budget
spent: nothing was released or charged), UNAVAILABLE (teachers not ready).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import grpc
import numpy as np

from protos import aggregator_pb2, aggregator_pb2_grpc


def encode_inputs(inputs: np.ndarray) -> aggregator_pb2.Tensor:
    """A float32 ``Tensor`` for a batch; floating arrays are cast, anything else is refused."""
    array = np.asarray(inputs)
    if not np.issubdtype(array.dtype, np.floating):
        raise TypeError(f"inputs must be floating point (scaled like the training data), got {array.dtype}")
    array = np.ascontiguousarray(array, dtype="<f4")
    return aggregator_pb2.Tensor(shape=list(array.shape), dtype="float32", data=array.tobytes())


class AggregatorClient:
    """Talk to one aggregator; plaintext unless ``root_cert`` (PEM path or bytes) is given."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        root_cert: str | Path | bytes | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        if root_cert is not None:
            pem = root_cert if isinstance(root_cert, bytes) else Path(root_cert).read_bytes()
            self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=pem), options)
        else:
            self._channel = grpc.insecure_channel(address, options)
        self._stub = aggregator_pb2_grpc.AggregatorStub(self._channel)

    def label(self, inputs: np.ndarray) -> np.ndarray:
        """Labels for one batch [batch, *input_shape]: int64, -1 = abstain."""
        return self.label_reply(inputs)[0]

    def label_reply(self, inputs: np.ndarray) -> tuple[np.ndarray, int, dict]:
        """(labels, answered count, budget snapshot after the batch) for one batch."""
        reply = self._stub.Label(
            aggregator_pb2.LabelRequest(inputs=encode_inputs(inputs)), timeout=self.timeout, metadata=self._metadata
        )
        return np.asarray(reply.labels, dtype=np.int64), int(reply.answered), _budget_dict(reply.budget)

    def label_stream(self, batches: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        """Labels for each batch, in order, over one bidirectional stream.

        The stream has no overall deadline (it may run for many batches). An error (e.g. RESOURCE_EXHAUSTED) ends the
        stream; batches answered before it were already yielded (and are cached server-side,
        so asking again costs nothing).
        """
        requests = (aggregator_pb2.LabelRequest(inputs=encode_inputs(batch)) for batch in batches)
        for reply in self._stub.LabelStream(requests, metadata=self._metadata):
            yield np.asarray(reply.labels, dtype=np.int64)

    def budget(self) -> dict:
        """The server's privacy budget and query counters (``BudgetReply`` fields)."""
        reply = self._stub.GetBudget(aggregator_pb2.BudgetRequest(), timeout=self.timeout, metadata=self._metadata)
        return _budget_dict(reply)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AggregatorClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _budget_dict(reply: aggregator_pb2.BudgetReply) -> dict:
    """The reply as a dict; ``guarantee`` is a nested dict (what may be published)."""
    budget = {field.name: getattr(reply, field.name) for field in aggregator_pb2.BudgetReply.DESCRIPTOR.fields}
    guarantee = reply.guarantee
    budget["guarantee"] = {field.name: getattr(guarantee, field.name)
                           for field in aggregator_pb2.Guarantee.DESCRIPTOR.fields}
    budget["guarantee"]["unsound_reasons"] = list(guarantee.unsound_reasons)
    return budget
