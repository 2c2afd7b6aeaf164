"""DP-SGD runs at the owner's gateway: a run's admission, its steps' keys and shares, NearPrivate's releases.

``Admit`` with DP-SGD terms plans the run's secure sum from public numbers and admits its whole
schedule; each ``Step`` (keyed by ``Keys`` as a round is, a key serving one step) is charged one
step, then answers with the masked share of the owner's noised clipped gradient sum (the plan and
the share: ``cluster.gateway.steps``). A sparse fine-tuning's terms bring the public pre-trained
weights and the public mask of the entries that train: its steps send those entries' values only.
With NearPrivate's terms, the two rounds after the steps are its releases, each charged, then
answered by ``NearPrivate`` with one masked share (``cluster.gateway.near_private``).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import grpc
import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from torch import nn

from conclave.cluster.gateway.declaration import Declaration
from conclave.cluster.gateway.identity import ForgedKey, Identity, StepKey, Verifier
from conclave.cluster.gateway.near_private import COUNTS, PCA, NearPrivateReleases
from conclave.cluster.gateway.runs import OwnerRuns
from conclave.cluster.gateway.steps import (DPSGD, DPSGD_PIPELINE, SPARSE_PIPELINE, AdmittedSteps, StepTerms,
                                             schedule_charge, signed_step_key, step_key_of)
from conclave.cluster.gateway.wire import (MAX_BATCH, MAX_ROUNDS, MAX_SEED, SHARE_DTYPE, Refused, check_run_name,
                                            decode_arguments, decode_reading, decode_standardiser, decode_tensor,
                                            decode_trained, decode_vector, decode_weights)
from conclave.errors import first_line
from conclave.learning.data.schema import Standardiser
from conclave.learning.models import build_model, check_model
from conclave.learning.models.registry import REGISTRY as MODELS, ModelContractError
from conclave.learning.owner_step import OwnerEmbeddings, OwnerSteps, load_parameters
from conclave.learning.secure_dpsgd import SecureAggregation
from conclave.learning.trained_entries import TrainedEntries
from conclave.privacy.accounting.guarantee import worst_case_guarantee
from conclave.privacy.accounting.ledger import BudgetExceeded
from conclave.privacy.accounting.rdp import sum_charges
from conclave.protos import owner_pb2

log = logging.getLogger(__name__)

MAX_CLIP = 1e6  # the largest clip bound a DP-SGD run may ask
MAX_RECORDS = 10**12  # the most records a DP-SGD run may declare, all owners together
MAX_PARAMETERS = 16 * 2**20  # a model's weights travel in one message (64 MiB of float32): no larger model is built


class DpsgdRuns:
    """The DP-SGD runs of one owner (``declaration``): admitted through ``runs`` (its policy and
    ledger), each step keyed with its signing ``identity``, every party's key checked by the consortium
    CA's ``verifier``. The caller holds the gateway's lock."""

    def __init__(self, declaration: Declaration, runs: OwnerRuns, identity: Identity, verifier: Verifier) -> None:
        self.declaration, self._runs = declaration, runs
        self._identity, self._verifier = identity, verifier

    def admit(self, request: owner_pb2.AdmitRequest) -> owner_pb2.AdmitReply:
        """A DP-SGD run: its terms checked, its whole schedule admitted by the policy, its secure sum
        planned on the registered model's trainable entries; nothing charged yet."""
        terms, classes, near_private = self._checked_terms(request)
        self._runs.check_unseen(request.run, "steps")
        declaration = self.declaration
        data = self._runs.owner_data(decode_reading(request.reading))  # a table in the pool's columns and fill
        planned = schedule_charge(terms.sample_rate, terms.noise_multiplier, int(terms.steps))
        releases: tuple[str, ...] = ()
        if near_private is not None:  # the whole run: the steps, then both releases
            planned = sum_charges([planned, *near_private.charges], label="planned")
            releases = tuple(charge.label for charge in near_private.charges)
        sparse = terms.HasField("sparse")
        # the policy's checks: nothing changed yet
        owner_terms = self._runs.admitted_terms(request, planned, SPARSE_PIPELINE if sparse else DPSGD_PIPELINE,
                                                releases)
        try:
            dataset, _ = data.read_private(classes, name=declaration.name)  # what was dropped stays here
        except (OSError, ValueError) as err:  # its file as declared (missing, not its format, a column): no record
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"owner {declaration.name}: {first_line(err)}") from None
        model, trained, fresh_model = self._built_model(terms, len(classes), tuple(dataset.x.shape[1:]))
        owner_steps = OwnerSteps(model, dataset.x, dataset.y, terms.sample_rate, int(terms.steps),
                                 declaration.records, terms.max_grad_norm, trained)
        embeddings = None
        if near_private is not None:  # its own copy of the model: the steps' stays theirs
            embeddings = OwnerEmbeddings(fresh_model(), dataset.x, declaration.records)
        del dataset
        try:
            plan = SecureAggregation(tuple(terms.parties), owner_steps.dimension).plan(
                terms.max_grad_norm, terms.noise_multiplier, int(terms.records), int(terms.steps))
        except ValueError as err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err).splitlines()[0]) from None
        step_terms = StepTerms(terms.model, terms.max_grad_norm, terms.noise_multiplier, terms.sample_rate,
                               int(terms.steps), tuple(terms.parties), int(terms.records), plan, sparse)
        if near_private is not None:
            try:  # the covariance's plan is fixed now: refused here rather than after the steps
                near_private.plan(PCA, embeddings.dimension, step_terms.parties, step_terms.records)
            except ValueError as err:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err).splitlines()[0]) from None
        self._runs.end_current(request.run)
        ledger = self._runs.open(owner_terms, planned, request.run, planned)
        self._runs.admitted(AdmittedSteps(request.run, step_terms, owner_steps, ledger, near_private, embeddings))
        delta = self._runs.lifetime.delta
        epsilon = worst_case_guarantee(planned, delta).epsilon
        log.info("run '%s' admitted: %s on %s (d = %d), clip %g, z %g, q %g, up to %d steps%s (planned ε %.4g)",
                 request.run, "sparse DP fine-tuning" if sparse else "DP-SGD", terms.model, plan.dimension,
                 terms.max_grad_norm, terms.noise_multiplier, terms.sample_rate, terms.steps,
                 ", then NearPrivate" if near_private else "", epsilon)
        return owner_pb2.AdmitReply(run=request.run, planned_epsilon=epsilon, delta=delta,
                                    cell_bound=declaration.records)

    def key(self, request: owner_pb2.KeysRequest) -> owner_pb2.SignedKey:
        """A fresh X25519 key for one step, signed over the step's plan terms (batch 1: one vector)."""
        run = self._admitted(request.run)
        if request.round <= run.last_keyed:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"step {request.round} of run '{run.run}' is not after step {run.last_keyed}, already "
                          "keyed: a step is keyed once")
        if request.round > run.terms.steps:
            self._plan_release(run, request)
        elif request.batch != 1:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"batch {request.batch}: a DP-SGD step releases one "
                                                            "vector; key it with batch 1")
        private = X25519PrivateKey.generate()
        run.keys[request.round], run.last_keyed = private, request.round
        key = run.step_key(self.declaration.name, self.declaration.records, request.round,
                           private.public_key().public_bytes_raw())
        return signed_step_key(key, self._identity.certificate_pem, self._identity.sign(key))

    def step(self, request: owner_pb2.StepRequest) -> owner_pb2.StepReply:
        """One step: its key used once, every party's key checked, the owner's ledger charged one step,
        then this owner's masked share of its noised clipped gradient sum at the weights sent."""
        run = self._admitted(request.run)
        if not 1 <= request.round <= run.terms.steps:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"run '{run.run}' was admitted for {run.terms.steps} steps, not step {request.round}")
        private = run.keys.pop(request.round, None)  # one use, whatever follows
        if private is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"step {request.round} of run '{run.run}' holds no unused key of this gateway (not "
                          "keyed, or answered already): a key serves one step")
        sent = self._sent_weights(run, request)
        mine = run.step_key(self.declaration.name, self.declaration.records, request.round,
                            private.public_key().public_bytes_raw())
        rank = self._checked_parties(run, request, mine)
        charge = run.terms.step_charge
        try:
            report = run.ledger.charge(charge, worst_case=charge)
        except BudgetExceeded as err:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{err}; nothing was released") from None
        # Charged: from here the step is a release. The clean sum stays inside ``share``.
        share = run.share(sent, request.round, rank, private, [p.public_key for p in request.parties])
        del private
        return owner_pb2.StepReply(share=owner_pb2.Tensor(shape=[share.size], dtype=SHARE_DTYPE,
                                                           data=share.astype("<i8").tobytes()),
                                   epsilon_spent=report.epsilon_spent, charges=report.charges)

    def near_private(self, request: owner_pb2.NearPrivateRequest) -> owner_pb2.StepReply:
        """One of NearPrivate's releases: its key used once, every party's key checked, the owner's
        ledger charged, then this owner's masked share under the checkpoint's weights."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        run = self._admitted(request.run)
        kind = NearPrivateReleases.kind(request.round, run.terms.steps) if run.near_private else None
        if kind is None:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"round {request.round} of run '{run.run}' is not "
                                                             "one of NearPrivate's releases it was admitted for")
        private = run.keys.pop(request.round, None)  # one use, whatever follows
        if private is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"round {request.round} of run '{run.run}' holds no unused key of this gateway (not "
                          "keyed, or answered already): a key serves one release")
        weights = decode_weights(request.weights, run.owner_steps.shapes)
        support = None
        if kind == COUNTS:
            d, k = run.embeddings.dimension, run.release_plans[request.round].dimension
            projection = decode_tensor(request.projection, "projection")
            if projection.ndim != 2 or projection.shape[0] != d or projection.shape[1] > d:
                raise Refused(invalid, f"projection: shape {list(projection.shape)} is not [{d}, p] with p <= {d}")
            points = decode_tensor(request.public_points, "public_points", (projection.shape[1],))
            if len(points) != k:
                raise Refused(invalid, f"public_points: {len(points)} rows, but the round was keyed for {k}")
            if not math.isfinite(request.threshold):
                raise Refused(invalid, "threshold must be a finite number")
            support = (projection.astype(np.float64), points.astype(np.float64), float(request.threshold))
        elif request.HasField("projection") or request.HasField("public_points"):
            raise Refused(invalid, "the DP-PCA covariance takes weights only: send no projection or points")
        mine = run.step_key(self.declaration.name, self.declaration.records, request.round,
                            private.public_key().public_bytes_raw())
        rank = self._checked_parties(run, request, mine)
        charge = run.near_private.release(kind).charge()
        try:
            report = run.ledger.charge(charge, worst_case=charge)
        except BudgetExceeded as err:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{err}; nothing was released") from None
        # Charged: from here the round is a release. The clean sum stays inside ``release_share``.
        share = run.release_share(request.round, weights, rank, private, [p.public_key for p in request.parties],
                                  support)
        del private
        return owner_pb2.StepReply(share=owner_pb2.Tensor(shape=[share.size], dtype=SHARE_DTYPE,
                                                           data=share.astype("<i8").tobytes()),
                                   epsilon_spent=report.epsilon_spent, charges=report.charges)

    def _checked_terms(self, request: owner_pb2.AdmitRequest
                       ) -> tuple[owner_pb2.DpsgdTerms, tuple[str, ...], NearPrivateReleases | None]:
        """The DP-SGD terms, the classes and NearPrivate's releases (None: not asked), within the
        registry and the protocol's bounds, or a refusal."""
        denied, invalid = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT
        check_run_name(request.run)
        terms, name = request.dpsgd, self.declaration.name
        if request.mechanism != DPSGD:
            raise Refused(denied, f"mechanism {request.mechanism[:40]!r}: DP-SGD terms release through '{DPSGD}'")
        if terms.model not in MODELS:
            raise Refused(denied, f"model {terms.model[:40]!r} is not registered ({', '.join(MODELS.names)}): a "
                                  "gateway runs no code a coordinator names")
        if not (0 < terms.max_grad_norm <= MAX_CLIP):
            raise Refused(invalid, f"dpsgd.max_grad_norm must be in (0, {MAX_CLIP:g}]")
        if not (terms.noise_multiplier > 0 and math.isfinite(terms.noise_multiplier)):
            raise Refused(invalid, "dpsgd.noise_multiplier must be a positive finite number")
        if not 0 < terms.sample_rate <= 1:
            raise Refused(invalid, "dpsgd.sample_rate must be in (0, 1]")
        if not 1 <= terms.steps <= MAX_ROUNDS:
            raise Refused(invalid, f"dpsgd.steps must be in [1, {MAX_ROUNDS}]")
        if not 0 <= terms.seed <= MAX_SEED:
            raise Refused(invalid, f"dpsgd.seed must be in [0, {MAX_SEED}]")
        parties = list(terms.parties)
        if name not in parties or len(set(parties)) != len(parties):
            raise Refused(invalid, f"dpsgd.parties must name each owner once, owner {name} among them")
        strangers = [p for p in parties if p not in self.declaration.parties]
        if strangers:
            raise Refused(denied, f"party {strangers[0][:40]!r} is not a declared peer of owner {name}")
        if not self.declaration.records <= terms.records <= MAX_RECORDS:
            raise Refused(invalid, f"dpsgd.records (the run's declared records) must be in "
                                   f"[{self.declaration.records}, {MAX_RECORDS}]: owner {name} alone declares "
                                   f"{self.declaration.records}")
        classes = tuple(request.classes)
        if len(classes) < 2 or len(set(classes)) != len(classes):
            raise Refused(invalid, "classes: at least two, distinct")
        if not (request.lifetime_epsilon >= 0 and math.isfinite(request.lifetime_epsilon)):
            raise Refused(invalid, "lifetime_epsilon must be a finite number >= 0 (0: the policy's)")
        if request.HasField("public_pool"):
            raise Refused(invalid, "public_pool: DP-SGD learns on the owner's records only; send none")
        near_private = None
        if terms.HasField("near_private") and terms.HasField("sparse"):
            raise Refused(invalid, "near_private: NearPrivate's releases go with active learning's DP-SGD, not with "
                                   "a sparse fine-tuning")
        if terms.HasField("near_private"):
            try:
                near_private = NearPrivateReleases.of(terms.near_private)
            except ValueError as err:
                raise Refused(invalid, str(err)) from None
        return terms, classes, near_private

    def _built_model(self, terms: owner_pb2.DpsgdTerms, classes: int, input_shape: tuple[int, ...]
                     ) -> tuple[nn.Module, TrainedEntries | None, Callable[[], nn.Module]]:
        """The run's model as its terms build it (checked against the model's contract; a sparse run's
        pre-trained weights loaded), the entries a sparse run trains (None: all), and how to build
        the same model afresh. Refused INVALID_ARGUMENT when the terms do not fit the model."""
        standardiser = decode_standardiser(terms, input_shape)
        arguments = decode_arguments(terms)
        shapes = self._model_shapes(terms.model, classes, input_shape, standardiser, arguments)  # refused if too big
        pretrained, trained = None, None
        if terms.HasField("sparse"):  # checked against the model's shapes before it is built
            pretrained = decode_weights(terms.sparse.pretrained, shapes, "sparse.pretrained")
            trained = decode_trained(terms.sparse, shapes)
        try:
            check_model(terms.model, classes, input_shape, standardiser=standardiser, **arguments)
        except ModelContractError as err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"dpsgd.model: {err}".splitlines()[0]) from None

        def fresh_model() -> nn.Module:
            return build_model(terms.model, classes, input_shape=input_shape, seed=int(terms.seed),
                               standardiser=standardiser, **arguments)

        model = fresh_model()
        if pretrained is not None:  # the frozen entries' values for the whole run
            load_parameters(model, pretrained)
        return model, trained, fresh_model

    @staticmethod
    def _model_shapes(model: str, classes: int, input_shape: tuple[int, ...], standardiser: Standardiser | None,
                      arguments: dict[str, int | float]) -> tuple[tuple[int, ...], ...]:
        """The registered model's parameter shapes, worked out without memory (on torch's meta device);
        refused when its weights could not travel in one message."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        try:
            with torch.device("meta"):
                shapes = tuple(tuple(p.shape) for p in build_model(model, classes, input_shape=input_shape,
                                                                   standardiser=standardiser, **arguments).parameters())
        except Exception as err:  # noqa: BLE001 - a factory given other arguments may raise anything: one line
            raise Refused(invalid, f"dpsgd.model: {model} cannot be built with {arguments or 'no arguments'}: "
                                   f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
        if sum(math.prod(shape) for shape in shapes) > MAX_PARAMETERS:
            raise Refused(invalid, f"dpsgd.model: {model} with {arguments or 'no arguments'} has more than "
                                   f"{MAX_PARAMETERS} parameters, more than a step's weights can carry")
        return shapes

    @staticmethod
    def _sent_weights(run: AdmittedSteps, request: owner_pb2.StepRequest) -> list[np.ndarray] | np.ndarray:
        """A step's weights: every parameter, or in a sparse run the trained entries' values [d] alone."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if run.terms.sparse:
            if request.weights:
                raise Refused(invalid, "weights: a sparse run's step sends its trained entries' values (trained), "
                                       "the rest being the admitted pre-trained weights")
            return decode_vector(request.trained, "trained", run.terms.plan.dimension)
        if request.HasField("trained"):
            raise Refused(invalid, "trained: only a sparse run's steps send trained entries; send every weight")
        return decode_weights(request.weights, run.owner_steps.shapes)

    def _admitted(self, run: str) -> AdmittedSteps:
        current = self._runs.current
        if current is None or current.run != run:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"run '{run[:40]}' is not admitted by this gateway")
        if not isinstance(current, AdmittedSteps):
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"run '{run[:40]}' is not a DP-SGD run: it takes votes, "
                                                             "not steps")
        return current

    def _plan_release(self, run: AdmittedSteps, request: owner_pb2.KeysRequest) -> None:
        """A NearPrivate round's plan, kept for its key and share (refused: not a round of this run)."""
        terms = run.terms
        kind = NearPrivateReleases.kind(request.round, terms.steps) if run.near_private else None
        if kind is None:
            after = " and NearPrivate's two releases" if run.near_private else ""
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"run '{run.run}' was admitted for {terms.steps} "
                                                             f"steps{after}, not round {request.round}")
        if kind == PCA and request.batch != 1:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"batch {request.batch}: the DP-PCA covariance is one "
                                                            "release; key it with batch 1")
        if kind == COUNTS and not 1 <= request.batch <= MAX_BATCH:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"batch {request.batch}: the support counts are for 1 to {MAX_BATCH} public points")
        size = run.embeddings.dimension if kind == PCA else int(request.batch)
        try:
            run.release_plans[request.round] = run.near_private.plan(kind, size, terms.parties, terms.records)
        except ValueError as err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err).splitlines()[0]) from None

    def _checked_parties(self, run: AdmittedSteps, request: owner_pb2.StepRequest | owner_pb2.NearPrivateRequest,
                         mine: StepKey) -> int:
        """This gateway's rank once every party's key verifies for this very round and plan (``mine``:
        this gateway's), the parties are the admitted ones in their order, and their declared records
        add up to the run's."""
        denied = grpc.StatusCode.PERMISSION_DENIED
        owners = tuple(party.owner for party in request.parties)
        if owners != run.terms.parties:
            raise Refused(denied, f"the round's parties {list(owners)[:8]} are not the run's admitted parties "
                                  f"{list(run.terms.parties)}, in that order")
        for party in request.parties:
            key = step_key_of(party)
            try:
                self._verifier.verify(key, party.certificate, party.signature)
            except ForgedKey as err:
                raise Refused(denied, str(err)) from None
            if key.terms() != mine.terms():
                raise Refused(denied, f"owner {party.owner}'s key is for another round or other terms (run, round, d, "
                                      "clip, scale, z, q, steps) than this one")
            if party.owner == self.declaration.name and key != mine:
                raise Refused(denied, f"the key given as owner {self.declaration.name}'s is not the one this "
                                      f"gateway made for round {request.round}")
        records = sum(int(party.cell_bound) for party in request.parties)
        if records != run.terms.records:
            raise Refused(denied, f"the parties declare {records} records; the run was admitted for "
                                  f"{run.terms.records}")
        return owners.index(self.declaration.name)
