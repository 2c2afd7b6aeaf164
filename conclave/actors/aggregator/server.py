"""The aggregator: private labels for inputs, from a vote source through a mechanism, every
answer charged first; served over gRPC (``service``) while its voters can vote (``health``).

``AggregatorServer`` labels in process too (no gRPC); ``AggregatorActor`` is it inside a Ray actor.
"""
from __future__ import annotations

import logging

import numpy as np
import ray

from conclave.actors.aggregator.health import VoterHealth
from conclave.actors.aggregator.service import AggregatorService
from conclave.actors.aggregator.settings import ServerSettings
from conclave.actors.labeller import (
    BudgetStatus, LabelOutcome, SecureVoteSource, TeachersUnavailable, VoteSource, labeller_for,
)
from conclave.learning.data.schema import InputSchema
from conclave.privacy.accounting.guarantee import Guarantee
from conclave.privacy.accounting.ledger import AnsweringLedger, PrivacyLedger
from conclave.privacy.mechanisms.base import SecureVoteMechanism, VoteMechanism
from conclave.privacy.noise import SECURE, NoisePolicy

log = logging.getLogger(__package__)  # the aggregator's one log, whichever of its parts writes


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
        self.health = VoterHealth(self.labeller.vote_source.ready, settings.health_interval, self._publish_health)
        self._service: AggregatorService | None = None
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
            self.health.failed()
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
        return self._operator_ready and self.health.alive

    def set_ready(self, ready: bool) -> None:
        """Mark the teachers ready (health SERVING when they can vote) or not (NOT_SERVING, Label → UNAVAILABLE)."""
        self._operator_ready = ready
        self._publish_health()

    def _publish_health(self) -> None:
        if self._service is not None:
            self._service.set_health(self.serving)

    # ---- the gRPC server ----

    def start(self) -> str:
        """Start serving; returns the bound address ``host:port``."""
        if self._service is not None:
            raise RuntimeError("aggregator already started")
        self._service = AggregatorService(self)
        try:
            port = self._service.start()
        except Exception:
            self._service = None
            raise
        self._address = f"{self.settings.host}:{port}"
        self._publish_health()
        self.health.start()
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
        self.health.stop()
        self._service.stop(grace)
        self._service = None
        log.info("aggregator on %s stopped", self._address)


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
