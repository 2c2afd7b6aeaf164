"""Noisy counts by the Laplace mechanism (Dwork & Roth 2014, Thm 3.6).

Used by NearPrivate: each private point votes for at most one public point. Adding or
removing one private point therefore changes exactly one count by at most 1 (L1
sensitivity 1), and adding Lap(1/ε) to every count is ε-DP (pure). This holds only when
whether a point votes is decided by that point alone (e.g. an uncertainty threshold fixed
without looking at the other private points), never by its rank among them — a top-k over
private points would let one addition evict another point and move two counts.

The counts are separable: each shard holder counts its own points. With one holder of all
the points, that holder draws the noise ONCE on its counts (``LaplaceCounts``): discrete
Laplace (``NoiseSource.laplace_counts``, exact), so the released counts are integers and no
float sampler's low bits leak (Mironov 2012); its pure ε is the continuous Laplace's.

With several holders, their counts meet only in a secure sum (``SkellamCounts``,
``privacy.secure_release``): each sends its count vector with a Skellam noise share under
pairwise masks, and whoever sums decodes only the noised total. The released counts are again
integers, now with Skellam noise, charged as the Skellam mechanism.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.rdp import pure_epsilon_charge
from conclave.privacy.accounting.skellam import skellam_charge
from conclave.privacy.noise import NoiseSource
from conclave.privacy.secure_release import CalibratedRelease, party_share, release_plan, summed_shares
from conclave.privacy.secure_sum import PairwiseMasks, SecureSumPlan, decode_integers


@dataclass(frozen=True)
class LaplaceCounts:
    """Discrete Laplace of scale 1/``epsilon`` on every count of a histogram with L1 sensitivity 1."""

    epsilon: float
    orders: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and np.isfinite(self.epsilon)):
            raise InvalidValue(f"epsilon must be a positive finite number, got {self.epsilon}")

    @property
    def scale(self) -> float:
        return 1.0 / self.epsilon

    def charge(self) -> PrivacyCharge:
        """Pure ε (charge the ledger with this before releasing)."""
        return pure_epsilon_charge(self.epsilon, label="noisy-counts", orders=self.orders)

    def summary(self) -> dict[str, Any]:
        """What ``privacy.json`` says about this release's noise."""
        return {"mechanism": "discrete Laplace added by the one holder", "scale": self.scale}

    def release(self, counts: np.ndarray, noise: NoiseSource) -> np.ndarray:
        return noise.laplace_counts(_checked_counts(counts), self.scale)


@dataclass(frozen=True)
class SkellamCounts(CalibratedRelease):
    """Counts summed across parties through the secure sum, with Skellam noise (``privacy.secure_release``).

    The count vectors are integers already (``integer_inputs``: no scaling, no rounding), and one
    private point added or removed moves one count by 1, so Δ₂ = Δ₁ = 1 exactly; the total
    carries Skellam noise of variance μ = z² against any one owner. The charge is the Skellam
    mechanism at those numbers (Agarwal, Kairouz & Liu 2021, Cor. 3.6), the same for every
    number of public points and parties, and z is the smallest multiplier whose charge gives at
    most ``epsilon`` at ``delta``.
    """

    def _charge_at(self, noise_multiplier: float) -> PrivacyCharge:
        return skellam_charge(1.0, 1.0, noise_multiplier**2, label="noisy-counts", orders=self.orders)


    def summary(self) -> dict[str, Any]:
        """What ``privacy.json`` says about this release's noise."""
        return {"mechanism": "Skellam noise shares through the secure sum", "noise_multiplier": self.noise_multiplier}

    def plan(self, size: int, owners: Sequence[str], norm_bound: float) -> SecureSumPlan:
        """The secure sum of ``size`` counts over parties ``owners[rank]``, each counting at most
        ``norm_bound`` points (public: the declared records; ‖counts‖₂ ≤ ‖counts‖₁)."""
        return release_plan(self.charge(), dimension=size, owners=owners, norm_bound=norm_bound,
                            noise_multiplier=self.noise_multiplier, integer_inputs=True, what="secure noisy counts")

    def share(self, counts: np.ndarray, plan: SecureSumPlan, owners: Sequence[str], masks: PairwiseMasks,
              noise: NoiseSource) -> np.ndarray:
        """One party's masked share of its counts (what leaves the party)."""
        return party_share(_checked_counts(counts), plan, owners, masks, noise)

    def release(self, shares: Sequence[np.ndarray], plan: SecureSumPlan) -> np.ndarray:
        """The noised total counts, int64 (one share per party)."""
        return decode_integers(summed_shares(shares, plan), plan).astype(np.int64)


def _checked_counts(counts: np.ndarray) -> np.ndarray:
    counts = np.asarray(counts)
    if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.integer):
        raise InvalidValue(f"expected a 1-D vector of integer counts, got {counts.dtype} {counts.shape}")
    if np.any(counts < 0):
        raise InvalidValue("counts must be non-negative")
    return counts
