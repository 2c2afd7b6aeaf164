"""PATE's vote histograms through the secure sum (``aggregation: secure``): whoever aggregates sees
only noised totals, never a teacher's or an owner's clean votes.

One *round* releases the vote histograms of a batch of B queries over k classes. Each party (a
teacher actor, on its owner's node) flattens its partial histograms — the votes of its own
teachers, ``int[B, k]`` — into one vector of B·k counts and sends ONE masked share of it
(``privacy.secure_sum``; ``privacy.secure_release`` for the one-round protocol): its counts, plus
its Skellam noise share drawn in its own process from OS entropy, plus pairwise masks from key
pairs made for this round alone. The aggregator adds the shares mod the ring and decodes the
noised histograms; a share on its own is uniform on the ring, whatever the votes in it.

**Sensitivity (one-vote neighbours, ``ONE_VOTE``).** Votes are integers: no scaling, no rounding
(``SecureSumPlan.integer_inputs``). When one teacher's vote moves from class a to class b, one
query's histogram changes by +1 and −1: Δ₁ = 2, Δ₂ = √2 per query. The teacher votes on every
query of the batch, so the round's vector moves by Δ₁ = 2B, Δ₂ = √(2B), and the Skellam bound
(Agarwal, Kairouz & Liu 2021, Cor. 3.6; ``privacy.accounting.skellam``) at those numbers is
exactly B times the per-query curve — every term is linear in Δ₂² and Δ₁ — which is also the
composition of B one-query releases (Mironov 2017, Prop. 1). ``vote_release_charge(σ, B)``
charges that. For GNMax it is the Gaussian curve λ/σ² of the clean mode (Papernot et al. 2018,
Prop. 8, which bounds the whole noisy histogram too) plus the discreteness term of Cor. 3.6.

**Noise (``SecureSumPlan.party_variances``).** Every owner, even one that subtracts its own noise
share, faces Skellam noise of variance σ² from the others' shares: with O ≥ 2 owners each adds
σ²/(O − 1), split across its actors, so the aggregator (who knows no share) sees variance
O·σ²/(O − 1) — the labels are noisier than the clean mode's at the same σ (1.5σ² with three
owners); with one owner, that owner adds σ² and the protection is against the aggregator.

**Ring.** A party's count in one cell is at most its number of teachers (public), so the ring is
sized from the largest party's teacher count (the plan's per-coordinate bound; integer inputs are
never projected) and the noise's Bernstein tail, as every plan is (``SecureSumPlan``).

A missing share leaves the total uniformly random: the round is aborted, releasing nothing and
charged nothing (``actors.teacher.TeacherPool.noised_votes``, ``actors.labeller.SecureLabeller``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from conclave.privacy.accounting.charge import ONE_VOTE, PrivacyCharge
from conclave.privacy.accounting.skellam import skellam_charge
from conclave.privacy.noise import NoiseSource
from conclave.privacy.secure_release import party_share, release_plan, summed_shares
from conclave.privacy.secure_sum import PairwiseMasks, SecureSumPlan, decode_integers

VOTE_L1 = 2.0  # one vote moving from class a to class b: +1 and −1 in one query's histogram
VOTE_L2 = math.sqrt(2.0)


def vote_release_charge(sigma: float, count: int, label: str, orders=None) -> PrivacyCharge:
    """``count`` vote histograms released with Skellam noise of variance σ² (one-vote neighbours):
    ``count`` times Cor. 3.6 at Δ₁ = 2, Δ₂ = √2, μ = σ²."""
    return skellam_charge(VOTE_L1, VOTE_L2, sigma**2, count=count, label=label, orders=orders,
                          neighbouring=ONE_VOTE)


@dataclass(frozen=True)
class SkellamVotes:
    """One round of vote histograms summed through the secure sum with Skellam noise of variance
    σ² against any one owner (module docstring); the parties' and the aggregator's steps."""

    sigma: float

    def __post_init__(self) -> None:
        if not (self.sigma > 0 and math.isfinite(self.sigma)):
            raise ValueError(f"secure votes: sigma must be a positive finite number, got {self.sigma}")

    def charge(self, count: int, label: str, orders=None) -> PrivacyCharge:
        """What releasing ``count`` noised histograms at this σ costs."""
        return vote_release_charge(self.sigma, count, label, orders)

    def plan(self, batch: int, classes: int, owners: Sequence[str], teachers: Sequence[int]) -> SecureSumPlan:
        """The secure sum of a batch of ``batch`` histograms over parties ``owners[rank]``, each
        holding ``teachers[rank]`` teachers (public); refused if it would cost more than
        ``charge(batch)``."""
        if len(teachers) != len(owners) or min(teachers, default=0) < 1:
            raise ValueError(f"secure votes: expected a positive teacher count for each of the {len(owners)} "
                             f"parties, got {list(teachers)}")
        if batch < 1 or classes < 2:
            raise ValueError(f"secure votes: a round needs queries and at least two classes, got batch {batch}, "
                             f"{classes} classes")
        l2 = math.sqrt(VOTE_L1 * batch)  # one teacher's votes over the whole batch
        return release_plan(self.charge(batch, "secure votes"), dimension=batch * classes, owners=owners,
                            norm_bound=float(max(teachers)), noise_multiplier=self.sigma / l2,
                            integer_inputs=True, what="secure PATE votes", sensitivity=l2)

    def share(self, votes: np.ndarray, plan: SecureSumPlan, owners: Sequence[str], masks: PairwiseMasks,
              noise: NoiseSource) -> np.ndarray:
        """What party ``masks.rank`` sends for its partial histograms ``int[batch, k]``: the counts,
        plus its Skellam noise share, masked (uniform on the ring on its own)."""
        counts = np.asarray(votes)
        if counts.ndim != 2 or counts.size != plan.dimension or not np.issubdtype(counts.dtype, np.integer):
            raise ValueError(f"expected integer partial histograms of {plan.dimension} counts in all, got "
                             f"{counts.dtype} {counts.shape}")
        return party_share(counts.reshape(-1), plan, owners, masks, noise)

    def total(self, shares: Sequence[np.ndarray], plan: SecureSumPlan, batch: int) -> np.ndarray:
        """The noised histograms ``int64[batch, k]`` from one share per party (ValueError if one is
        missing: without it the total is noise)."""
        return decode_integers(summed_shares(shares, plan), plan).astype(np.int64).reshape(batch, -1)
