"""PATE's vote histograms through the secure sum (``aggregation: secure``): whoever aggregates sees
only noised totals, never a teacher's or an owner's clean votes.

One round releases a batch's histograms: each party sends one masked share of its partial counts
with its Skellam noise share. What one neighbour moves, and so the charge, is the vote source's
(``VoteBound``: teachers, kNN votes, public clusters). A round is charged once its shares are
asked for. Why a round costs B one-query releases: docs/privacy.md, "A secure vote round".
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.sampled_skellam import VOTE_SHIFT_L1, VOTE_SHIFT_L2, sampled_skellam_vote_charge
from conclave.privacy.accounting.skellam import skellam_charge
from conclave.privacy.noise import NoiseSource
from conclave.privacy.secure_release import party_share, release_plan, summed_shares
from conclave.privacy.secure_sum import PairwiseMasks, SecureSumPlan, decode_integers

VOTE_L1 = 2.0  # one vote moving from class a to class b: +1 and −1 in one query's histogram
VOTE_L2 = math.sqrt(2.0)


@dataclass(frozen=True)
class VoteBound:
    """How far one neighbour moves a round's vote histograms (integers), under which relation.

    ``per_query``: the bound holds for every query's histogram, so a round of B queries moves by
    Δ₁ = B·l1, Δ₂ = √B·l2 and costs B one-query releases; otherwise it holds for the whole round,
    which costs one release whatever B. ``sample_rate`` < 1: each query's histogram reads its own
    Poisson sample of the records (kNN votes), whose shifts are the kNN lemma's (l1 = 2, l2 = √2)."""

    l1: float
    l2: float
    neighbouring: Neighbouring
    per_query: bool = True
    sample_rate: float = 1.0

    def __post_init__(self) -> None:
        if not (self.l1 >= self.l2 > 0):
            raise InvalidValue(f"a vote bound needs l1 >= l2 > 0, got {self.l1}, {self.l2}")
        if not 0 < self.sample_rate <= 1:
            raise InvalidValue(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        if self.sample_rate < 1 and (not self.per_query or (self.l1, self.l2) != (VOTE_SHIFT_L1, VOTE_SHIFT_L2)):
            raise InvalidValue("a sampled vote bound is the kNN lemma's: per query, l1 = 2, l2 = √2")

    def round_sensitivity(self, batch: int) -> tuple[float, float]:
        """(Δ₁, Δ₂) of a whole round of ``batch`` queries."""
        return (self.l1 * batch, math.sqrt(batch) * self.l2) if self.per_query else (self.l1, self.l2)

    def charge(self, sigma: float, count: int, label: str, orders=None) -> PrivacyCharge:
        """``count`` queries released through rounds with Skellam noise of variance σ² (count 0: free)."""
        if self.sample_rate < 1:
            return sampled_skellam_vote_charge(self.sample_rate, sigma**2, count=count, label=label, orders=orders)
        releases = count if self.per_query else min(count, 1)
        return skellam_charge(self.l1, self.l2, sigma**2, count=releases, label=label, orders=orders,
                              neighbouring=self.neighbouring)

    def unsampled_charge(self, sigma: float, count: int, label: str, orders=None) -> PrivacyCharge:
        """The charge without the sampling's amplification: the curve a round's ring must stay under."""
        releases = count if self.per_query else min(count, 1)
        return skellam_charge(self.l1, self.l2, sigma**2, count=releases, label=label, orders=orders,
                              neighbouring=self.neighbouring)


# One teacher's vote moves from class a to class b on every query (one-vote neighbours).
TEACHER_VOTES = VoteBound(VOTE_L1, VOTE_L2, Neighbouring.ONE_VOTE)


def knn_votes(sample_rate: float) -> VoteBound:
    """kNN votes on a fresh Poisson sample per query: one record moves one vote of each query's sample."""
    return VoteBound(VOTE_SHIFT_L1, VOTE_SHIFT_L2, Neighbouring.ADD_REMOVE, sample_rate=sample_rate)


def cluster_votes(votes_per_record: int) -> VoteBound:
    """Public-cluster votes: one record adds 1 to m cells of the whole round (its m nearest queries, its label)."""
    return VoteBound(float(votes_per_record), math.sqrt(votes_per_record), Neighbouring.ADD_REMOVE, per_query=False)


def vote_release_charge(sigma: float, count: int, label: str, orders=None) -> PrivacyCharge:
    """``count`` teachers' vote histograms released with Skellam noise of variance σ² (one-vote
    neighbours): ``count`` times Cor. 3.6 at Δ₁ = 2, Δ₂ = √2, μ = σ²."""
    return TEACHER_VOTES.charge(sigma, count, label, orders)


@dataclass(frozen=True)
class SkellamVotes:
    """One round of vote histograms summed through the secure sum with Skellam noise of variance
    σ² against any one owner (module docstring); the parties' and the aggregator's steps. ``bound``
    says what one neighbour moves (the vote source's), hence the charge."""

    sigma: float
    bound: VoteBound = TEACHER_VOTES

    def __post_init__(self) -> None:
        if not (self.sigma > 0 and math.isfinite(self.sigma)):
            raise InvalidValue(f"secure votes: sigma must be a positive finite number, got {self.sigma}")

    def charge(self, count: int, label: str, orders=None) -> PrivacyCharge:
        """What releasing ``count`` noised histograms at this σ costs."""
        return self.bound.charge(self.sigma, count, label, orders)

    def plan(self, batch: int, classes: int, owners: Sequence[str], cell_bounds: Sequence[int]) -> SecureSumPlan:
        """The secure sum of a batch of ``batch`` histograms over parties ``owners[rank]``, party
        ``rank`` counting at most ``cell_bounds[rank]`` votes in one cell (public: its teachers, its
        k nearest, its declared records); refused if it would cost more than the unsampled charge."""
        if len(cell_bounds) != len(owners) or min(cell_bounds, default=0) < 1:
            raise InvalidValue(f"secure votes: expected a positive count bound for each of the {len(owners)} "
                             f"parties, got {list(cell_bounds)}")
        if batch < 1 or classes < 2:
            raise InvalidValue(f"secure votes: a round needs queries and at least two classes, got batch {batch}, "
                             f"{classes} classes")
        l2 = self.bound.round_sensitivity(batch)[1]
        return release_plan(self.bound.unsampled_charge(self.sigma, batch, "secure votes"), dimension=batch * classes,
                            owners=owners, norm_bound=float(max(cell_bounds)), noise_multiplier=self.sigma / l2,
                            integer_inputs=True, what="secure votes", sensitivity=l2)

    def share(self, votes: np.ndarray, plan: SecureSumPlan, owners: Sequence[str], masks: PairwiseMasks,
              noise: NoiseSource) -> np.ndarray:
        """What party ``masks.rank`` sends for its partial histograms ``int[batch, k]``: the counts,
        plus its Skellam noise share, masked (uniform on the ring on its own)."""
        counts = np.asarray(votes)
        if counts.ndim != 2 or counts.size != plan.dimension or not np.issubdtype(counts.dtype, np.integer):
            raise InvalidValue(f"expected integer partial histograms of {plan.dimension} counts in all, got "
                             f"{counts.dtype} {counts.shape}")
        return party_share(counts.reshape(-1), plan, owners, masks, noise)

    def total(self, shares: Sequence[np.ndarray], plan: SecureSumPlan, batch: int) -> np.ndarray:
        """The noised histograms ``int64[batch, k]`` from one share per party (ValueError if one is
        missing: without it the total is noise)."""
        return decode_integers(summed_shares(shares, plan), plan).astype(np.int64).reshape(batch, -1)
