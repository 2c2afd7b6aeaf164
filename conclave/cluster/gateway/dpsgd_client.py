"""The coordinator's side of DP-SGD through the owners' gateways: the model's steps, each a secure sum.

``GatewayDpsgd`` admits the run at every gateway (a registered model, the clip bound, the noise
multiplier, the Poisson rate, the steps, the parties in rank order and their declared records), then
runs each step as the gateways allow: every gateway's signed step key (checked: the CA, the owner,
this step and one plan for all), the coordinator's own charge (its view; each owner's ledger charged
on its own machine is the authority), every gateway's masked share for the current weights, then the
noised total decoded on the plan the signed terms fix, divided by the run's expected batch q·N, and
the optimizer's step on the coordinator's copy of the model. It never holds a clean gradient; a
gateway that fails a step aborts the run, ``OwnerDropout`` naming the owner.

A sparse fine-tuning (``DpsgdTerms.sparse``) sends the public pre-trained weights and the public
mask of the entries that train once, at admission; each step then sends those entries' values and
decodes their d-entry total alone (``learning.trained_entries``): frozen entries get no gradient.

A run admitted with NearPrivate's releases (``DpsgdTerms.near_private``) then offers them as a
``PrivateSupport`` (``GatewaySupport``): each release keyed at every gateway like a step, refused before
any key when the coordinator's ledger cannot afford it, charged there once the keys are in (each owner's
ledger is charged on its machine), and decoded from the gateways' masked shares.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from conclave.actors.dp_trainer import EMBED_RECORD_S, DPCheckpoint
from conclave.actors.owners import OwnerDropout
from conclave.cluster.gateway.client import (GatewayRoster, OwnerGateway, float_tensor, reading_message,
                                             time_left)
from conclave.cluster.gateway.identity import ForgedKey, Verifier
from conclave.cluster.gateway.near_private import COUNTS, OFFSET_OF, PCA, NearPrivateReleases
from conclave.cluster.gateway.steps import DPSGD, schedule_charge, step_key_of
from conclave.cluster.run_privacy import GatewayAccount
from conclave.errors import InvalidValue
from conclave.learning.data.schema import Standardiser
from conclave.learning.data.sources import PublicReading
from conclave.learning.dp_schedule import dp_step_charge
from conclave.learning.secure_dpsgd import SecureAggregation
from conclave.learning.trained_entries import TrainedEntries
from conclave.privacy.accounting.guarantee import worst_case_guarantee
from conclave.privacy.accounting.ledger import BudgetExceeded, ChargeGate, Ledger
from conclave.privacy.secure_release import summed_shares
from conclave.privacy.secure_sum import SecureSumPlan, decode
from conclave.progress import COUNTS as COUNTS_BAR  # not NearPrivate's COUNTS
from conclave.protos import owner_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class SparseTerms:
    """A sparse fine-tuning's public start: every parameter's ``pretrained`` weights (the new
    classifier's included), fixed for the run, and the ``trained`` entries (the variant's public mask)."""

    pretrained: tuple[np.ndarray, ...]
    trained: TrainedEntries

    @classmethod
    def of(cls, model: nn.Module, masks: Mapping[str, torch.Tensor]) -> SparseTerms:
        """``model`` as it is now, training its parameters with ``requires_grad`` inside ``masks``
        (a ``learning.sparse.SparsePlan``'s)."""
        pretrained = tuple(p.detach().cpu().numpy().astype(np.float32) for p in model.parameters())
        return cls(pretrained, TrainedEntries.of_masks(model, masks))

    def message(self) -> owner_pb2.SparseTerms:
        return owner_pb2.SparseTerms(pretrained=[float_tensor(w) for w in self.pretrained], trained=[
            owner_pb2.TrainedEntries(parameter=index, entries=[] if flat is None else flat.tolist())
            for index, flat in self.trained.entries])


@dataclass(frozen=True)
class DpsgdTerms:
    """A DP-SGD run through the gateways: a registered ``model`` (with its own keyword ``arguments``,
    numbers), clip bound, noise multiplier z, Poisson rate q (the same at every owner), the most
    ``steps``, and the model's ``seed``; ``near_private``: NearPrivate's two releases after the steps,
    admitted with them (None: none); ``sparse``: a sparse fine-tuning's public start (None: every
    entry of the model trains)."""

    model: str
    max_grad_norm: float
    noise_multiplier: float
    sample_rate: float
    steps: int
    seed: int = 0
    near_private: NearPrivateReleases | None = None
    arguments: tuple[tuple[str, int | float], ...] = ()
    sparse: SparseTerms | None = None


class GatewayDpsgd:
    """DP-SGD steps on the owners' records through their ``gateways`` (rank order) for run ``run``,
    classifying ``classes``. ``ledger``: the coordinator's own view, charged one step before each
    step's shares are asked (None: none kept). ``lifetime_epsilon``: a lower lifetime ε the run asks
    each owner to stay within (None: the owners' policies). ``reading``: how the owners' data are read
    (the public pool's columns and fill, or its image size); ``standardiser``: a table model's input
    scaling, the public pool's statistics (None: images)."""

    def __init__(self, gateways: Sequence[OwnerGateway], verifier: Verifier, run: str, terms: DpsgdTerms,
                 classes: Sequence[str], lifetime_epsilon: float | None = None, ledger: Ledger | None = None,
                 step_timeout_s: float = 60.0, admit_timeout_s: float = 120.0, release_rate_s: float = EMBED_RECORD_S,
                 reading: PublicReading = PublicReading(), standardiser: Standardiser | None = None) -> None:
        if not gateways:
            raise InvalidValue("DP-SGD through gateways needs at least one owner's gateway")
        self._verifier, self.run, self.terms = verifier, run, terms
        self._ledger, self.step_timeout_s = ledger, step_timeout_s
        self._release_rate_s = release_rate_s  # a NearPrivate share's time per declared record (embedded one by one)
        self._step_charge = schedule_charge(terms.sample_rate, terms.noise_multiplier, 1)  # its view's, each step
        self.gateways = GatewayRoster(gateways, step_timeout_s)
        self.owners, self.charges_before = self.gateways.owners, self.gateways.charges_before
        self.records = sum(self.gateways.declared)  # public
        self.expected_batch = terms.sample_rate * self.records
        self._step = 0
        try:
            self._admit(classes, lifetime_epsilon, admit_timeout_s, reading, standardiser)
        except BaseException:
            self.shutdown()
            raise

    def _admit(self, classes: Sequence[str], lifetime_epsilon: float | None, admit_timeout_s: float,
               reading: PublicReading, standardiser: Standardiser | None) -> None:
        run, terms = self.run, self.terms
        request = owner_pb2.AdmitRequest(run=run, mechanism=DPSGD, lifetime_epsilon=lifetime_epsilon or 0.0,
                                         classes=list(classes), dpsgd=owner_pb2.DpsgdTerms(
                                             model=terms.model, max_grad_norm=terms.max_grad_norm,
                                             noise_multiplier=terms.noise_multiplier, sample_rate=terms.sample_rate,
                                             steps=terms.steps, seed=terms.seed, parties=list(self.owners),
                                             records=self.records, standardiser=_standardiser(standardiser),
                                             near_private=terms.near_private and terms.near_private.message(),
                                             arguments=[_argument(name, value) for name, value in terms.arguments],
                                             sparse=terms.sparse and terms.sparse.message()),
                                         reading=reading_message(reading))
        self.admitted = self.gateways.each(lambda index, gateway: gateway.admit(request, admit_timeout_s),
                                           "did not admit the run", admitting=True)
        log.info("DP-SGD run '%s' admitted by %s", run, ", ".join(
            f"{owner} (planned ε {a.planned_epsilon:.3g})" for owner, a in zip(self.owners, self.admitted)))

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """One step: the noised clipped gradient sum of every owner's Poisson batch at ``model``'s
        weights, over q·N, as ``model``'s gradient, then ``optimizer.step()``. A sparse run sends and
        decodes its trained entries alone; the others get no gradient."""
        parameters = list(model.parameters())
        sparse = self.terms.sparse
        trained = sparse.trained if sparse is not None else TrainedEntries.every(model)
        plan = SecureAggregation(self.owners, trained.dimension).plan(
            self.terms.max_grad_norm, self.terms.noise_multiplier, self.records, self.terms.steps)
        self._step += 1
        step = self._step
        deadline = time.monotonic() + self.step_timeout_s
        keys = self._keyed(step, 1, plan, self.terms.noise_multiplier, "a DP-SGD step", deadline)
        if self._ledger is not None:
            self._ledger.charge(self._step_charge)
        request = owner_pb2.StepRequest(run=self.run, round=step, parties=keys)
        if sparse is not None:
            request.trained.CopyFrom(float_tensor(trained.values(parameters)))
        else:
            request.weights.extend(float_tensor(p.detach().cpu().numpy()) for p in parameters)
        replies = self.gateways.each(lambda index, gateway: gateway.step(request, time_left(deadline)),
                             "sent no share of a DP-SGD step: the run is aborted; its shares were asked, so it was "
                             "charged; nothing of it is decoded", deadline)
        shares = [_share(reply, plan.dimension) for reply in replies]
        gradient = torch.from_numpy(decode(summed_shares(shares, plan), plan) / self.expected_batch)
        trained.set_gradients(parameters, gradient)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def train(self, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int | None = None) -> nn.Module:
        """``steps`` steps (None: every admitted step left); ``model``, trained."""
        for _ in range(self.terms.steps - self._step if steps is None else steps):
            self.step(model, optimizer)
        return model

    def checkpoints(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, epochs: int, delta: float,
                    progress: bool = True) -> list[DPCheckpoint]:
        """Every admitted step, in ``epochs`` epochs of equal steps (``scheduler`` stepped after each step),
        and one checkpoint per epoch: ``model``'s state and its worst-case ε at ``delta``."""
        terms = self.terms
        if terms.steps % epochs:
            raise InvalidValue(f"{terms.steps} steps do not make {epochs} epochs of equal steps")
        per_epoch, checkpoints = terms.steps // epochs, []
        bar = tqdm(range(1, epochs + 1), desc="DP-SGD", unit="epochs", bar_format=COUNTS_BAR, disable=not progress)
        for epoch in bar:
            for _ in range(per_epoch):
                self.step(model, optimizer)
                scheduler.step()
            steps = per_epoch * epoch
            charge = dp_step_charge(terms.sample_rate, terms.noise_multiplier, steps, DPSGD, True)
            state = {key: value.detach().cpu().numpy().copy() for key, value in model.state_dict().items()}
            checkpoints.append(DPCheckpoint(epoch, float(worst_case_guarantee(charge, delta).epsilon), delta,
                                            terms.sample_rate, terms.noise_multiplier, steps, state, secure=True))
        return checkpoints

    def support(self, weights: Sequence[np.ndarray], dimension: int, gate: ChargeGate) -> GatewaySupport:
        """NearPrivate's releases under ``weights`` (a DP checkpoint's parameters, in the model's order;
        ``dimension``: the width of its embeddings), charged to ``gate`` before their shares are asked."""
        if self.terms.near_private is None:
            raise InvalidValue(f"run '{self.run}' was admitted without NearPrivate's releases")
        return GatewaySupport(self, [np.asarray(w, dtype=np.float32) for w in weights], dimension, gate)

    def release(self, kind: str, batch: int, plan: SecureSumPlan, weights: list[np.ndarray], gate: ChargeGate,
                **support: object) -> list[np.ndarray]:
        """Every gateway's masked share of NearPrivate's release ``kind`` (``batch``: its public points,
        or 1), refused before any key when ``gate`` cannot afford it, charged to it once the keys are in."""
        release = self.terms.near_private.release(kind)
        cost = release.charge()
        if not gate.can_afford(cost):
            raise BudgetExceeded(f"NearPrivate's {kind}: the run's budget cannot afford this release; nothing "
                                 "was computed")
        round_ = self.terms.steps + OFFSET_OF[kind]
        deadline = time.monotonic() + self.step_timeout_s + self._release_rate_s * max(self.gateways.declared)
        keys = self._keyed(round_, batch, plan, release.noise_multiplier, f"NearPrivate's {kind}", deadline)
        gate.charge(cost)
        request = owner_pb2.NearPrivateRequest(run=self.run, round=round_, parties=keys,
                                               weights=[float_tensor(w) for w in weights], **support)
        replies = self.gateways.each(lambda index, gateway: gateway.near_private(request, time_left(deadline)),
                             f"sent no share of NearPrivate's {kind}: the run is aborted; its shares were asked, "
                             "so it was charged; nothing of it is decoded", deadline)
        return [_share(reply, plan.dimension) for reply in replies]

    def accounts(self, budget_sources: Mapping[str, str] | None = None,
                 charges_before: Mapping[str, int] | None = None) -> dict[str, GatewayAccount]:
        """Each owner's lifetime account as its gateway reports it now (``budget_sources``: where each
        owner's budget comes from, where the run knows it; ``charges_before``: each ledger's charges
        before the run began, where an earlier admitted run of it came first, else before this one's)."""
        return self.gateways.accounts(budget_sources, charges_before)

    def shutdown(self) -> None:
        self.gateways.shutdown()

    def _keyed(self, round_: int, batch: int, plan: SecureSumPlan, multiplier: float, what: str,
               deadline: float) -> list[owner_pb2.SignedKey]:
        """Every gateway's key for ``round_``, each checked against the round's plan and multiplier."""
        keys = self.gateways.each(lambda index, gateway: gateway.keys(self.run, round_, batch, time_left(deadline)),
                          f"sent no key for {what}: the run is aborted; no share was asked, so nothing was "
                          "released or charged", deadline)
        for owner, key in zip(self.owners, keys):
            self._check_key(owner, key, round_, plan, multiplier)
        return keys

    def _check_key(self, owner: str, key: owner_pb2.SignedKey, round_: int, plan: SecureSumPlan,
                   multiplier: float) -> None:
        signed = step_key_of(key)
        terms = self.terms
        expected = (owner, self.run, round_, plan.dimension, terms.max_grad_norm, plan.scale_bits, multiplier,
                    terms.sample_rate, terms.steps)
        try:
            if (signed.owner, *signed.terms()) != expected:
                raise ForgedKey(f"owner {owner}'s gateway signed a key for other terms than this round's")
            self._verifier.verify(signed, key.certificate, key.signature)
        except ForgedKey as err:
            raise OwnerDropout(f"{err}: the run is aborted; nothing was released or charged") from None


def _argument(name: str, value: int | float) -> owner_pb2.ModelArgument:
    if isinstance(value, int):
        return owner_pb2.ModelArgument(name=name, integer=value)
    return owner_pb2.ModelArgument(name=name, real=value)


def _standardiser(standardiser: Standardiser | None) -> owner_pb2.Standardiser | None:
    if standardiser is None:
        return None
    keep = [] if standardiser.keep is None else standardiser.keep.tolist()
    return owner_pb2.Standardiser(mean=standardiser.mean.tolist(), scale=standardiser.scale.tolist(), keep=keep)


def _share(reply: owner_pb2.StepReply, dimension: int) -> np.ndarray:
    share = reply.share
    if share.dtype != "int64" or list(share.shape) != [dimension] or len(share.data) != 8 * dimension:
        raise OwnerDropout(f"a gateway sent a malformed share ({share.dtype} {list(share.shape)}): nothing is decoded")
    return np.frombuffer(share.data, dtype="<i8").copy()


class GatewaySupport:
    """NearPrivate's ``PrivateSupport`` (``learning.selection.near_private``) through the gateways of
    ``run`` under one checkpoint's ``weights``: the DP-PCA projection, then the noisy support counts."""

    def __init__(self, run: GatewayDpsgd, weights: list[np.ndarray], dimension: int, gate: ChargeGate) -> None:
        self._run, self._weights, self._dimension, self._gate = run, weights, dimension, gate
        self._releases = run.terms.near_private

    def dp_projection(self, components: int) -> np.ndarray:
        plan = self._releases.plan(PCA, self._dimension, self._run.owners, self._run.records)
        shares = self._run.release(PCA, 1, plan, self._weights, self._gate)
        return self._releases.pca.release(shares, components, plan)

    def noisy_support(self, projection: np.ndarray, public_points: np.ndarray, threshold: float) -> np.ndarray:
        plan = self._releases.plan(COUNTS, len(public_points), self._run.owners, self._run.records)
        shares = self._run.release(COUNTS, len(public_points), plan, self._weights, self._gate,
                                   projection=float_tensor(projection), public_points=float_tensor(public_points),
                                   threshold=float(threshold))
        return self._releases.counts.release(shares, plan)
