"""DP-SGD steps at the owner's gateway: an admitted run's plan and state, and each step's share.

A run's secure sum is planned at admission from public numbers only (the registered model's
trainable entries d, the clip bound C, the noise multiplier z, the parties in rank order, the
run's declared records, the steps), as ``learning.secure_dpsgd`` plans it across shard actors;
its whole schedule, the Poisson-subsampled Skellam at the dominating sensitivity
(``learning.dp_schedule.secure_charge``), is what the owner's policy admits. Each step is then
charged one step of that curve in the owner's ledger before anything is computed, and answers with
one masked share: the owner's clipped gradient sum quantized, plus its Skellam noise share from OS
entropy, plus pairwise masks from the step's own keys (``privacy.secure_release.party_share``).
A sparse fine-tuning's run (``SparseTerms``: public pre-trained weights and the public mask of the
entries that train) is planned on those entries alone, d of them; each step sends their values and
the other entries keep the pre-trained ones. A run admitted with NearPrivate's terms then answers
its two releases the same way (``cluster.gateway.near_private``): rounds steps + 1 and steps + 2,
keyed on their own plans.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from conclave.cluster.gateway.identity import StepKey
from conclave.cluster.gateway.near_private import PCA, NearPrivateReleases
from conclave.learning.dp_schedule import secure_charge
from conclave.learning.owner_step import OwnerEmbeddings, OwnerSteps
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.owner_ledger import OwnerLedger
from conclave.privacy.noise import SECURE
from conclave.privacy.secure_release import party_share
from conclave.privacy.secure_sum import MaskKeys, SecureSumPlan
from conclave.protos import owner_pb2

DPSGD = "dpsgd"  # the release's name, as policies list it (``cluster.owner_command.OTHER_RELEASES``)
# The pipeline DP-SGD on owners' records belongs to, as policies name pipelines: the student's
# DP-SGD of ``active_learning`` is what a coordinator runs through the owners' gateways.
DPSGD_PIPELINE = "active_learning"
SPARSE_PIPELINE = "sparse_finetune"  # a run with sparse terms: sparse DP fine-tuning of public weights


@dataclass(frozen=True)
class StepTerms:
    """An admitted DP-SGD run's public terms and the secure sum's plan they fix."""

    model: str
    max_grad_norm: float
    noise_multiplier: float
    sample_rate: float
    steps: int
    parties: tuple[str, ...]
    records: int  # the run's declared records, all owners together
    plan: SecureSumPlan
    sparse: bool = False  # steps send the trained entries' values (d of them), the rest being pre-trained

    @cached_property
    def step_charge(self) -> PrivacyCharge:
        """One step: the Poisson-subsampled Skellam at the dominating sensitivity (worked out once per
        run: the subsampled bound costs tens of milliseconds, every step would pay them)."""
        return schedule_charge(self.sample_rate, self.noise_multiplier, 1)


@dataclass
class AdmittedSteps:
    """One admitted DP-SGD run: its terms, the owner's model and batches, its ledger, its step keys."""

    run: str
    terms: StepTerms
    owner_steps: OwnerSteps
    ledger: OwnerLedger
    near_private: NearPrivateReleases | None = None  # admitted with the run, or not at all
    embeddings: OwnerEmbeddings | None = None  # NearPrivate's private side (with ``near_private``)
    keys: dict[int, X25519PrivateKey] = field(default_factory=dict)  # keyed rounds whose key is unused
    release_plans: dict[int, SecureSumPlan] = field(default_factory=dict)  # NearPrivate's keyed rounds
    last_keyed: int = 0

    def step_key(self, owner: str, records: int, round_: int, public_key: bytes) -> StepKey:
        """The key a party signs for ``round_``: a step's on the run's plan, a NearPrivate release's on
        the plan it was keyed with (its dimension, scale and its own noise multiplier)."""
        terms, plan, multiplier = self.terms, self.terms.plan, self.terms.noise_multiplier
        if round_ > terms.steps:
            kind = NearPrivateReleases.kind(round_, terms.steps)
            plan, multiplier = self.release_plans[round_], self.near_private.release(kind).noise_multiplier
        return StepKey(owner, public_key, records, self.run, round_, plan.dimension, terms.max_grad_norm,
                       plan.scale_bits, multiplier, terms.sample_rate, terms.steps)

    def share(self, weights: list[np.ndarray] | np.ndarray, step: int, rank: int, private: X25519PrivateKey,
              public_keys: list[bytes]) -> np.ndarray:
        """This owner's masked share of the step at ``weights`` (every parameter; a sparse run's: the
        trained entries' values) (charge it first): nothing else of the gradient leaves."""
        session = f"conclave/owner-step/{self.run}/{step}"
        masks = MaskKeys(rank, private).pairwise_masks(public_keys, session)
        steps = self.owner_steps
        clipped = steps.clipped_sum_at(weights) if self.terms.sparse else steps.clipped_sum(weights)
        share = party_share(clipped, self.terms.plan, self.terms.parties, masks, SECURE.source(session))
        del clipped
        return share

    def release_share(self, round_: int, weights: list[np.ndarray], rank: int, private: X25519PrivateKey,
                      public_keys: list[bytes], support: tuple[np.ndarray, np.ndarray, float] | None) -> np.ndarray:
        """This owner's masked share of NearPrivate's release ``round_`` (charge it first): the
        covariance, or (``support``: projection, public points, threshold) the support counts."""
        kind = NearPrivateReleases.kind(round_, self.terms.steps)
        session = f"conclave/owner-near-private/{self.run}/{round_}"
        masks = MaskKeys(rank, private).pairwise_masks(public_keys, session)
        plan, parties = self.release_plans[round_], self.terms.parties
        if kind == PCA:
            part = self.embeddings.covariance(weights)
            share = self.near_private.pca.share(part, plan, parties, masks, SECURE.source(session))
        else:
            part = self.embeddings.counts(weights, *support)
            share = self.near_private.counts.share(part, plan, parties, masks, SECURE.source(session))
        del part
        return share

    def stop(self) -> None:
        self.keys.clear()
        self.ledger.close()


def schedule_charge(sample_rate: float, noise_multiplier: float, steps: int) -> PrivacyCharge:
    """``steps`` steps at any plan of multiplier z (all admitted steps: what the policy admits)."""
    return secure_charge(sample_rate, noise_multiplier, steps, DPSGD)


def step_key_of(key: owner_pb2.SignedKey) -> StepKey:
    """The step key a ``SignedKey`` message claims to be (verify it before trusting it)."""
    return StepKey(key.owner, key.public_key, int(key.cell_bound), key.run, int(key.round), int(key.dimension),
                   key.max_grad_norm, int(key.scale_bits), key.sigma, key.sample_rate, int(key.steps))


def signed_step_key(key: StepKey, certificate_pem: bytes, signature: bytes) -> owner_pb2.SignedKey:
    return owner_pb2.SignedKey(owner=key.owner, certificate=certificate_pem, public_key=key.public_key,
                               cell_bound=key.records, run=key.run, round=key.round, batch=1, classes=0,
                               sigma=key.noise_multiplier, signature=signature, dimension=key.dimension,
                               max_grad_norm=key.max_grad_norm, scale_bits=key.scale_bits, steps=key.steps,
                               sample_rate=key.sample_rate)
