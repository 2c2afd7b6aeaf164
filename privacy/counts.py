"""Noisy counts by the Laplace mechanism (Dwork & Roth 2014, Thm 3.6).

Used by NearPrivate: each private point votes for at most one public point. Adding or
removing one private point therefore changes exactly one count by at most 1 (L1
sensitivity 1), and adding Lap(1/ε) to every count is ε-DP (pure). This holds only when
whether a point votes is decided by that point alone (e.g. an uncertainty threshold fixed
without looking at the other private points), never by its rank among them — a top-k over
private points would let one addition evict another point and move two counts.

The counts are separable: each shard holder counts its own points, the driver-side release
adds the partial counts and draws the noise ONCE on the total. The noise is discrete Laplace
(``NoiseSource.laplace_counts``, exact), so the released counts are integers and no float
sampler's low bits leak (Mironov 2012); its pure ε is the continuous Laplace's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from privacy.accounting.charge import PrivacyCharge
from privacy.accounting.rdp import pure_epsilon_charge
from privacy.noise import NoiseSource


@dataclass(frozen=True)
class LaplaceCounts:
    """Discrete Laplace of scale 1/``epsilon`` on every count of a histogram with L1 sensitivity 1."""

    epsilon: float
    orders: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and np.isfinite(self.epsilon)):
            raise ValueError(f"epsilon must be a positive finite number, got {self.epsilon}")

    @property
    def scale(self) -> float:
        return 1.0 / self.epsilon

    def charge(self) -> PrivacyCharge:
        """Pure ε (charge the ledger with this before releasing)."""
        return pure_epsilon_charge(self.epsilon, label="noisy-counts", orders=self.orders)

    def release(self, counts: np.ndarray, noise: NoiseSource) -> np.ndarray:
        counts = np.asarray(counts)
        if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.integer):
            raise ValueError(f"expected a 1-D vector of integer counts, got {counts.dtype} {counts.shape}")
        if np.any(counts < 0):
            raise ValueError("counts must be non-negative")
        return noise.laplace_counts(counts, self.scale)
