"""Public-cluster votes (reverse kNN): every private record votes, with its label, for its m nearest
queries of a batch, and the batch's whole [B × classes] histogram is released once with noise.

Li et al., "Fine-grained private knowledge distillation" (arXiv 2207.13253; reference code
liyuntong9/rknn): the queries are typically medoids of clusters of the public pool in a public
embedding, so labelling them labels every cluster. One record touches exactly min(m, B) cells of
the release — (its nearest query, its label), ..., ties broken by query order — so adding or
removing it moves the histogram by ℓ1 m, ℓ2 √m (``CLUSTER_LEMMA``), and the whole batch costs ONE
release whatever B (parallel composition across the queries), instead of one charge per query.

What is released per query is a label: the argmax of the noised counts, where the noised top
count reaches ``threshold`` and holds at least ``purity`` of the query's noised total (clipped at
zero) — both post-processing of the one release, free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.rdp import gaussian_charge
from conclave.privacy.mechanisms.base import (ABSTAIN, Description, MechanismResult, NoisedVotes,
                                              SecureVoteMechanism, VoteMechanism, parameters_of)
from conclave.privacy.mechanisms.votes import check_votes
from conclave.privacy.secure_votes import VoteBound, cluster_votes

CLUSTER_LEMMA = ("each record votes, with its label, for its m nearest queries of the batch (ties by query order), "
                 "so adding or removing it moves m cells of the batch's histograms by one (L1 m, L2 √m): one release "
                 "per batch")


def _check(sigma: float, votes_per_record: int, threshold: float, purity: float) -> None:
    if not (sigma > 0 and math.isfinite(sigma)):
        raise InvalidValue(f"public-clusters: sigma must be a positive finite number, got {sigma}")
    if not (isinstance(votes_per_record, int) and votes_per_record >= 1):
        raise InvalidValue(f"public-clusters: votes_per_record must be an integer >= 1, got {votes_per_record!r}")
    if not math.isfinite(threshold):
        raise InvalidValue(f"public-clusters: threshold must be a finite number, got {threshold}")
    if not 0 <= purity < 1:
        raise InvalidValue(f"public-clusters: purity must be in [0, 1), got {purity}")


def cluster_answers(noised: np.ndarray, threshold: float, purity: float) -> np.ndarray:
    """Labels from a noised histogram [B, k]: the argmax where the top count reaches ``threshold``
    and holds ``purity`` of the row's total clipped at zero, else ``ABSTAIN``."""
    top = noised.max(axis=1)
    total = np.clip(noised, 0, None).sum(axis=1)
    confident = (top >= threshold) & (top > 0) & (top >= purity * total)
    return np.where(confident, np.argmax(noised, axis=1), ABSTAIN).astype(np.int64)


@dataclass(frozen=True)
class SecurePublicClusterVotes(SecureVoteMechanism):
    """One secure round per batch: every owner's partial [B × k] histogram of its records' votes,
    summed through the secure sum with Skellam noise of variance σ² against any one owner; labels as
    the clean mechanism's. Charge per batch: Agarwal, Kairouz & Liu 2021, Cor. 3.6 at Δ₁ = m,
    Δ₂ = √m, μ = σ² (``privacy.secure_votes.cluster_votes``)."""

    sigma: float
    votes_per_record: int
    threshold: float = 0.0
    purity: float = 0.0
    name: ClassVar[str] = "secure-public-clusters"
    paired_with: ClassVar[tuple[str, ...]] = ("votes_per_record",)  # ``actors.labeller.check_pairing``

    def __post_init__(self) -> None:
        _check(self.sigma, self.votes_per_record, self.threshold, self.purity)

    @property
    def vote_bound(self) -> VoteBound:
        return cluster_votes(self.votes_per_record)

    def answer(self, noised: NoisedVotes, batch_size: int) -> np.ndarray:
        return cluster_answers(noised(np.arange(batch_size), self.sigma), self.threshold, self.purity)

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        return self.vote_bound.charge(self.sigma, batch_size, self.name)

    def run_charge(self, asked: int, answered: int) -> PrivacyCharge:
        """The worst batching: one release per asked query."""
        return self.vote_bound.charge(self.sigma, 1, self.name).scaled(asked)

    def describe(self) -> Description:
        return Description(self.name, parameters_of(self),
                           "per batch: the histogram of every record's votes for its m nearest queries, summed through "
                           "the secure sum with Skellam noise of variance sigma^2; per query the argmax where confident",
                           "Agarwal, Kairouz & Liu 2021, Cor. 3.6 at Δ₁ = m, Δ₂ = √m, μ = σ², once per batch",
                           bounded=True)


@dataclass(frozen=True)
class PublicClusterVotes(VoteMechanism):
    """argmax of the batch's histogram plus N(0, σ²) on every count, where confident (module
    docstring). Charge per batch: the Gaussian mechanism at ℓ2 sensitivity √m, λ·m/(2σ²)
    (Mironov 2017, Prop. 7), one record added or removed — not per query."""

    sigma: float
    votes_per_record: int
    threshold: float = 0.0
    purity: float = 0.0
    name: ClassVar[str] = "public-clusters"
    stateless: ClassVar[bool] = True
    aliases: ClassVar[dict[str, str]] = {"m": "votes_per_record"}
    secure_variant: ClassVar[type[SecureVoteMechanism]] = SecurePublicClusterVotes
    # The vote source must give each record exactly this many votes (``actors.labeller.check_pairing``).
    paired_with: ClassVar[tuple[str, ...]] = ("votes_per_record",)
    help: ClassVar[dict[str, str]] = {
        "sigma": "noise sigma on every count of the batch's histogram",
        "votes_per_record": "m: each record votes for its m nearest queries of the batch (set by the clusters section)",
        "threshold": "answer only where the noised top count reaches this",
        "purity": "answer only where the top count holds this share of the query's noised total",
    }

    def __post_init__(self) -> None:
        _check(self.sigma, self.votes_per_record, self.threshold, self.purity)

    def __call__(self, votes: np.ndarray, rng: np.random.Generator) -> MechanismResult:
        counts = check_votes(votes).astype(float)
        noised = counts + rng.normal(0.0, self.sigma, size=counts.shape)
        return MechanismResult(cluster_answers(noised, self.threshold, self.purity),
                               self.worst_case_charge(len(counts)))

    def _release(self) -> PrivacyCharge:
        return gaussian_charge(self.sigma / math.sqrt(self.votes_per_record), label=self.name,
                               neighbouring=Neighbouring.ADD_REMOVE)

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        return self._release() if batch_size > 0 else self._release().scaled(0)

    def run_charge(self, asked: int, answered: int) -> PrivacyCharge:
        """The worst batching: one release per asked query."""
        return self._release().scaled(asked)

    def describe(self) -> Description:
        return Description(self.name, parameters_of(self),
                           "per batch: the histogram of every record's votes for its m nearest queries plus "
                           "N(0, sigma^2) on every count; per query the argmax where confident",
                           "Gaussian mechanism at ℓ2 sensitivity √m (Mironov 2017, Prop. 7), once per batch; "
                           "Li et al. 2022 (reverse kNN)", bounded=True)
