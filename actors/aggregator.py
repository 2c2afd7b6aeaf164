"""The teacher aggregator: a gRPC server that turns teacher votes into private labels.

For each batch of public inputs it (1) validates the tensor, (2) answers inputs it has seen
before from a cache — same answer, no new cost, no fresh noise a client could average
away — and for the rest (3) asks the vote source (the teachers) for vote histograms,
(4) runs the configured vote mechanism, (5) charges the privacy ledger, and only then
(6) commits the mechanism's state, caches and releases the labels. A refused charge
releases, caches, charges and advances nothing.

The mechanisms' charges hold for one teacher's vote; the vote source states the record-level
relation its sharding gives (``neighbouring`` with a ``neighbouring_lemma``), and the
charges are restated for it before they reach the ledger, which composes one relation only.
Noise comes from the run's ``NoisePolicy`` (OS entropy unless reproducible noise was asked
for, which marks the budget reply unsound). The budget reply carries the guarantee the
server can back: its ledger's declared budget (none without one).

Around that core: bearer-token authentication (a server interceptor), optional TLS, the
standard health service (SERVING once the teachers are ready) and server reflection, so a
client that has nothing but the address can discover and call the service.

Status codes: INVALID_ARGUMENT (bad tensor), UNAUTHENTICATED, RESOURCE_EXHAUSTED (the ledger
refused), UNAVAILABLE (teachers not ready or failing).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import math
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import grpc
import numpy as np
import ray
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from privacy.accounting.charge import PrivacyCharge
from privacy.accounting.guarantee import Guarantee, unbounded_guarantee
from privacy.accounting.ledger import BudgetExceeded, BudgetReport, PrivacyLedger
from privacy.mechanisms.base import ABSTAIN, VoteMechanism
from privacy.noise import SECURE, NoisePolicy
from protos import aggregator_pb2, aggregator_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = aggregator_pb2.DESCRIPTOR.services_by_name["Aggregator"].full_name
INPUT_DTYPE = np.dtype("<f4")  # the one dtype the wire format accepts ("float32")


class VoteSource(Protocol):
    """What the aggregator needs from the teachers (``actors.teacher.TeacherPool``)."""

    neighbouring: str  # the record-level relation under which one record moves at most one vote
    neighbouring_lemma: str  # why

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        """int [batch, num_classes] vote histogram for float32 inputs [batch, *input_shape]."""
        ...


@dataclass(frozen=True)
class ServerSettings:
    """Where and how the aggregator listens.

    ``port=0`` picks a free port (``AggregatorServer.start`` returns the bound address).
    With ``token`` set, Aggregator calls need ``authorization: Bearer <token>`` metadata;
    with ``tls_cert`` and ``tls_key`` (PEM files) the port speaks TLS.
    """

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    max_batch: int = 1024
    tls_cert: str | None = None
    tls_key: str | None = None
    max_workers: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key (PEM files), or neither")
        if self.token is not None and not self.token:
            raise ValueError("token must be non-empty (or None for no authentication)")
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {self.max_workers}")


class InvalidInput(ValueError):
    """A request tensor the aggregator cannot label; the message names the problem."""


class TeachersUnavailable(RuntimeError):
    """The vote source is not ready or failed to vote."""


def decode_inputs(tensor: aggregator_pb2.Tensor, input_shape: tuple[int, ...], max_batch: int) -> np.ndarray:
    """The float32 array [batch, *input_shape] a ``Tensor`` carries, or ``InvalidInput``."""
    shape = tuple(int(d) for d in tensor.shape)
    expected = "[batch, " + ", ".join(str(d) for d in input_shape) + "]"
    if len(shape) != 1 + len(input_shape) or shape[1:] != tuple(input_shape):
        raise InvalidInput(f"wrong shape {list(shape)}: inputs must have shape {expected}")
    batch = shape[0]
    if batch <= 0:
        raise InvalidInput(f"empty batch (shape {list(shape)}): send at least one input")
    if batch > max_batch:
        raise InvalidInput(f"batch of {batch} inputs is over this server's maximum of {max_batch}")
    if tensor.dtype != "float32":
        raise InvalidInput(f"dtype {tensor.dtype!r} is not supported: send 'float32' (little-endian)")
    expected_bytes = math.prod(shape) * INPUT_DTYPE.itemsize
    if len(tensor.data) != expected_bytes:
        raise InvalidInput(
            f"data has {len(tensor.data)} bytes, but shape {list(shape)} of float32 needs {expected_bytes}"
        )
    inputs = np.frombuffer(tensor.data, dtype=INPUT_DTYPE).reshape(shape)
    finite = np.isfinite(inputs.reshape(batch, -1)).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise InvalidInput(f"inputs contain NaN or infinity (examples {bad[:5].tolist()}{'...' if bad.size > 5 else ''})")
    # Teachers learned on images scaled to [0, 1] (learning.data.Dataset); anything else is a
    # client bug (e.g. raw 0–255 bytes) that would buy labels for meaningless inputs.
    in_range = ((inputs >= 0) & (inputs <= 1)).reshape(batch, -1).all(axis=1)
    if not in_range.all():
        bad = np.flatnonzero(~in_range)
        raise InvalidInput(f"pixel values must be in [0, 1] (examples {bad[:5].tolist()}{'...' if bad.size > 5 else ''}"
                           f" hold values in [{inputs.min():g}, {inputs.max():g}])")
    return inputs.astype(np.float32)  # native byte order, writable copy


def input_keys(inputs: np.ndarray) -> list[bytes]:
    """Cache key of each example: sha256 of its float32 bytes."""
    flat = np.ascontiguousarray(inputs, dtype=INPUT_DTYPE).reshape(len(inputs), -1)
    return [hashlib.sha256(row.tobytes()).digest() for row in flat]


class AggregatorServer:
    """Serve private labels for ``input_shape`` inputs from ``vote_source`` over gRPC.

    ``noise`` is the run's noise policy (OS entropy by default). ``ready=False`` starts with health NOT_SERVING and Label refused with
    UNAVAILABLE until ``set_ready(True)`` (e.g. while teachers still train).
    """

    def __init__(
        self,
        vote_source: VoteSource,
        mechanism: VoteMechanism,
        ledger: PrivacyLedger,
        input_shape: tuple[int, ...],
        settings: ServerSettings = ServerSettings(),
        noise: NoisePolicy = SECURE,
        ready: bool = True,
    ) -> None:
        self._vote_source = vote_source
        self._mechanism = mechanism
        self._ledger = ledger
        self.input_shape = tuple(int(d) for d in input_shape)
        self.settings = settings
        self._noise = noise
        self._rng = noise.source("aggregator").rng
        self._ready = ready
        # One lock around the charge step: cache check, mechanism (may be stateful), ledger, cache write.
        self._lock = threading.Lock()
        self._cache: dict[bytes, int] = {}
        self._votes: list[np.ndarray] = []  # histograms the mechanism answered, in order
        self._labels: list[np.ndarray] = []  # what it released for them (ABSTAIN included)
        self._answered = self._abstained = self._cache_hits = 0  # distinct inputs; repeats
        self._health = health.HealthServicer()
        self._server: grpc.Server | None = None
        self._address: str | None = None

    # ---- the labelling core (usable in-process, without gRPC) ----

    def label(self, inputs: np.ndarray) -> tuple[np.ndarray, BudgetReport]:
        """Labels (int64, ABSTAIN = -1) for validated float32 inputs [batch, *input_shape]."""
        if not self._ready:
            raise TeachersUnavailable("teachers are not ready yet; retry when health reports SERVING")
        keys = input_keys(inputs)
        with self._lock:
            fresh = self._uncached(keys)
        newly_answered = 0
        if fresh:
            worst = self._for_ledger(self._mechanism.worst_case_charge(len(fresh)))
            # Data-independent early refusal: no point asking teachers for votes we may not release.
            self._require_affordable(worst, len(fresh))
            fresh_votes = self._teacher_votes(inputs[list(fresh.values())], len(fresh))
            with self._lock:
                newly_answered = self._answer_fresh(fresh, fresh_votes)
        with self._lock:
            labels = np.array([self._cache[key] for key in keys], dtype=np.int64)
            self._cache_hits += len(keys) - newly_answered
        return labels, self._ledger.report()

    def _uncached(self, keys: list[bytes]) -> dict[bytes, int]:
        """First row index of each distinct key not yet answered (dedupes within the batch)."""
        fresh: dict[bytes, int] = {}
        for row, key in enumerate(keys):
            if key not in self._cache and key not in fresh:
                fresh[key] = row
        return fresh

    def _require_affordable(self, worst: PrivacyCharge, count: int) -> None:
        if not self._ledger.can_afford(worst):
            report = self._ledger.report()
            raise BudgetExceeded(
                f"privacy budget exhausted: labelling {count} new inputs could cost more than the budget "
                f"ε={report.epsilon_limit:.4g} at δ={report.delta:g} has left (realised spend ε={report.epsilon_spent:.4g})"
            )

    def _teacher_votes(self, inputs: np.ndarray, count: int) -> np.ndarray:
        try:
            votes = np.asarray(self._vote_source.votes(inputs))
        except Exception as err:  # teachers' failures must not leak their details to clients
            log.warning("vote source failed: %r", err)
            raise TeachersUnavailable(f"teachers failed to vote ({type(err).__name__}); retry later") from err
        if votes.ndim != 2 or votes.shape[0] != count or not np.issubdtype(votes.dtype, np.integer) or (votes < 0).any():
            log.error("vote source returned %s %s for %d inputs", votes.dtype, votes.shape, count)
            raise TeachersUnavailable("teachers returned malformed vote histograms")
        return votes.astype(np.int64)

    def _answer_fresh(self, fresh: dict[bytes, int], fresh_votes: np.ndarray) -> int:
        """Mechanism → ledger → cache for inputs still unanswered (returns how many); caller holds the lock."""
        # Another request may have answered some of these while we waited for the teachers.
        keep = [i for i, key in enumerate(fresh) if key not in self._cache]
        if not keep:
            return 0
        keys = [key for key in fresh if key not in self._cache]
        votes = fresh_votes[keep]
        worst = self._for_ledger(self._mechanism.worst_case_charge(len(keep)))
        self._require_affordable(worst, len(keep))  # before the (possibly stateful) mechanism runs
        result = self._mechanism(votes, self._rng)
        labels = np.asarray(result.labels, dtype=np.int64)
        if labels.shape != (len(keep),):
            raise RuntimeError(f"mechanism {self._mechanism.name} returned {labels.shape} labels for {len(keep)} inputs")
        charge = self._for_ledger(result.charge)
        if not charge.is_free:  # e.g. an open stability run, paid when it opened
            self._ledger.charge(charge, worst_case=worst)  # raises BudgetExceeded: nothing released or advanced
        result.commit()
        self._cache.update(zip(keys, labels.tolist()))
        self._votes.append(votes)
        self._labels.append(labels)
        self._answered += int((labels != ABSTAIN).sum())
        self._abstained += int((labels == ABSTAIN).sum())
        return len(keep)

    def _for_ledger(self, charge: PrivacyCharge) -> PrivacyCharge:
        """The mechanism's one-vote charge restated for the ledger's record-level relation."""
        if charge.neighbouring == self._ledger.neighbouring:
            return charge
        relation = getattr(self._vote_source, "neighbouring", None)
        if relation != self._ledger.neighbouring:
            raise RuntimeError(f"the vote source does not say how one-vote charges hold for the ledger's "
                               f"{self._ledger.neighbouring!r} neighbours")
        return charge.for_records(relation, self._vote_source.neighbouring_lemma)

    def guarantee(self) -> Guarantee:
        """What this server can back: its ledger's budget, declared in advance (none without one)."""
        report = self._ledger.report()
        reasons = (self._noise.unsound_reason,) if self._noise.unsound_reason else ()
        if report.guarantee is None:
            return unbounded_guarantee(report.delta, report.neighbouring,
                                       "no budget was declared: an open-ended service has no guarantee "
                                       "(epsilon_spent is the realised spend, not a bound)").marked(reasons)
        return report.guarantee.marked(reasons)

    def answered_votes(self) -> tuple[np.ndarray, np.ndarray]:
        """(votes int64 [m, k], answered bool [m]) for every input the mechanism saw, in order.

        This is what the run's privacy report analyses (abstentions cost privacy too).
        """
        with self._lock:
            if not self._votes:
                classes = int(getattr(self._vote_source, "num_classes", 0))
                return np.zeros((0, classes), dtype=np.int64), np.zeros(0, dtype=bool)
            return np.concatenate(self._votes), np.concatenate(self._labels) != ABSTAIN

    def budget(self) -> dict:
        """The ``BudgetReply`` fields as a dict (``guarantee`` as a nested dict)."""
        with self._lock:
            counters = (self._answered, self._abstained, self._cache_hits)
        report, guarantee = self._ledger.report(), self.guarantee()
        return {
            "epsilon_spent": float(report.epsilon_spent),
            "delta": float(report.delta),
            "epsilon_limit": float(report.epsilon_limit),
            "mechanism": self._mechanism.name,
            "sound": guarantee.sound,
            "queries_answered": counters[0],
            "queries_abstained": counters[1],
            "cache_hits": counters[2],
            "guarantee": {"epsilon": float(guarantee.epsilon), "delta": float(guarantee.delta),
                          "basis": guarantee.basis, "neighbouring": guarantee.neighbouring,
                          "theorem": guarantee.theorem, "order": guarantee.order or 0.0,
                          "unsound_reasons": list(guarantee.unsound_reasons)},
        }

    # ---- readiness, health and the gRPC server ----

    def set_ready(self, ready: bool) -> None:
        """Mark the teachers ready (health SERVING) or not (NOT_SERVING, Label → UNAVAILABLE)."""
        self._ready = ready
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            self._health.set(service, status)

    def start(self) -> str:
        """Start serving; returns the bound address ``host:port``."""
        if self._server is not None:
            raise RuntimeError("aggregator already started")
        settings = self.settings
        interceptors = [_BearerTokenInterceptor(settings.token)] if settings.token else []
        batch_bytes = settings.max_batch * math.prod(self.input_shape) * INPUT_DTYPE.itemsize
        # Room for batches somewhat over max_batch, so they get INVALID_ARGUMENT, not a size error.
        max_message = max(64 << 20, 2 * batch_bytes + (1 << 20))
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=settings.max_workers, thread_name_prefix="aggregator"),
            interceptors=interceptors,
            options=[("grpc.max_receive_message_length", max_message)],
        )
        aggregator_pb2_grpc.add_AggregatorServicer_to_server(_AggregatorServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        self.set_ready(self._ready)
        target = f"{settings.host}:{settings.port}"
        if settings.tls_cert:
            credentials = grpc.ssl_server_credentials(
                [(Path(settings.tls_key).read_bytes(), Path(settings.tls_cert).read_bytes())]
            )
            port = server.add_secure_port(target, credentials)
        else:
            port = server.add_insecure_port(target)
        if port == 0:
            raise OSError(f"could not bind the aggregator to {target}")
        server.start()
        self._server = server
        self._address = f"{settings.host}:{port}"
        log.info(
            "aggregator serving on %s (%s, %s, mechanism %s)",
            self._address,
            "TLS" if settings.tls_cert else "plaintext",
            "token auth" if settings.token else "no auth",
            self._mechanism.name,
        )
        return self._address

    @property
    def address(self) -> str | None:
        return self._address

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving (in-flight calls get ``grace`` seconds)."""
        if self._server is None:
            return
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        self._server = None
        log.info("aggregator on %s stopped", self._address)


class _AggregatorServicer(aggregator_pb2_grpc.AggregatorServicer):
    """gRPC face of ``AggregatorServer``: decode, label, map failures to status codes."""

    def __init__(self, aggregator: AggregatorServer) -> None:
        self._aggregator = aggregator

    def Label(self, request: aggregator_pb2.LabelRequest, context: grpc.ServicerContext) -> aggregator_pb2.LabelReply:
        return self._answer(request, context, "Label")

    def LabelStream(
        self, requests: Iterator[aggregator_pb2.LabelRequest], context: grpc.ServicerContext
    ) -> Iterator[aggregator_pb2.LabelReply]:
        for request in requests:
            yield self._answer(request, context, "LabelStream")

    def GetBudget(self, request: aggregator_pb2.BudgetRequest, context: grpc.ServicerContext) -> aggregator_pb2.BudgetReply:
        return budget_reply(self._aggregator.budget())

    def _answer(self, request: aggregator_pb2.LabelRequest, context: grpc.ServicerContext, method: str):
        aggregator = self._aggregator
        try:
            inputs = decode_inputs(request.inputs, aggregator.input_shape, aggregator.settings.max_batch)
            labels, _ = aggregator.label(inputs)
        except InvalidInput as err:
            log.debug("%s from %s: rejected, %s", method, context.peer(), err)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except BudgetExceeded as err:
            log.debug("%s from %s: budget refused", method, context.peer())
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{err}; nothing was released or charged")
        except TeachersUnavailable as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except Exception:  # a bug must not look like a client error, nor leak internals
            log.exception("%s failed", method)
            context.abort(grpc.StatusCode.INTERNAL, "internal error in the aggregator (see its log)")
        budget = aggregator.budget()
        answered = int((labels != ABSTAIN).sum())
        log.debug("%s from %s: %d inputs, %d labelled", method, context.peer(), len(labels), answered)
        return aggregator_pb2.LabelReply(labels=labels.tolist(), answered=answered, budget=budget_reply(budget))


def budget_reply(budget: dict) -> aggregator_pb2.BudgetReply:
    """The ``BudgetReply`` message of ``AggregatorServer.budget()``."""
    fields = {**budget, "guarantee": aggregator_pb2.Guarantee(**budget["guarantee"])}
    return aggregator_pb2.BudgetReply(**fields)


class _BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuse Aggregator calls without ``authorization: Bearer <token>`` (health and reflection stay open)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._protected = f"/{SERVICE_NAME}/"

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._protected):
            return handler
        supplied = [value for key, value in handler_call_details.invocation_metadata or () if key == "authorization"]
        if not supplied:
            return _refusal(handler, "missing 'authorization: Bearer <token>' metadata")
        value = supplied[0] if isinstance(supplied[0], bytes) else supplied[0].encode()
        if len(supplied) == 1 and hmac.compare_digest(value, self._expected):
            return handler
        return _refusal(handler, "invalid bearer token")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED."""

    def refuse(request_or_iterator, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


@ray.remote(num_cpus=0)
class AggregatorActor:
    """``AggregatorServer`` inside a Ray actor (it uses no CPU slot: teachers do the work).

    The ledger is opened inside the actor from its path (an SQLite handle cannot travel),
    with the budget the caller declared.
    """

    def __init__(
        self,
        vote_source: VoteSource,
        mechanism: VoteMechanism,
        ledger_path: str,
        delta: float,
        budget,
        input_shape: tuple[int, ...],
        settings: ServerSettings = ServerSettings(),
        noise: NoisePolicy = SECURE,
        ready: bool = True,
    ) -> None:
        self._ledger = PrivacyLedger(ledger_path, delta, budget, neighbouring=vote_source.neighbouring)
        self._server = AggregatorServer(
            vote_source, mechanism, self._ledger, input_shape, settings, noise=noise, ready=ready
        )

    def start(self) -> str:
        return self._server.start()

    def stop(self) -> None:
        self._server.stop()
        self._ledger.close()

    def set_ready(self, ready: bool) -> None:
        self._server.set_ready(ready)

    def budget(self) -> dict:
        return self._server.budget()

    def _for_ledger(self, charge: PrivacyCharge) -> PrivacyCharge:
        """The mechanism's one-vote charge restated for the ledger's record-level relation."""
        if charge.neighbouring == self._ledger.neighbouring:
            return charge
        relation = getattr(self._vote_source, "neighbouring", None)
        if relation != self._ledger.neighbouring:
            raise RuntimeError(f"the vote source does not say how one-vote charges hold for the ledger's "
                               f"{self._ledger.neighbouring!r} neighbours")
        return charge.for_records(relation, self._vote_source.neighbouring_lemma)

    def guarantee(self) -> Guarantee:
        """What this server can back: its ledger's budget, declared in advance (none without one)."""
        report = self._ledger.report()
        reasons = (self._noise.unsound_reason,) if self._noise.unsound_reason else ()
        if report.guarantee is None:
            return unbounded_guarantee(report.delta, report.neighbouring,
                                       "no budget was declared: an open-ended service has no guarantee "
                                       "(epsilon_spent is the realised spend, not a bound)").marked(reasons)
        return report.guarantee.marked(reasons)

    def answered_votes(self) -> tuple[np.ndarray, np.ndarray]:
        return self._server.answered_votes()
