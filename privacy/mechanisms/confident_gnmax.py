"""Confident-GNMax: answer only when the teachers agree strongly (Papernot et al., ICLR 2018)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from privacy.accounting.charge import PrivacyCharge
from privacy.accounting.rdp import gaussian_charge, sum_charges
from privacy.mechanisms.base import ABSTAIN, MechanismResult
from privacy.mechanisms.gnmax import gnmax_charge
from privacy.mechanisms.votes import check_votes


@dataclass(frozen=True)
class ConfidentGNMax:
    """If max_j n_j + N(0, σ1²) ≥ T answer GNMax(σ2), else abstain (their Algorithm 1).

    Charge: the threshold test on every query — max_j n_j has sensitivity 1, so it is the
    Gaussian mechanism with multiplier σ1, λ/(2σ1²) — plus GNMax's λ/σ2² on the answered
    queries only (the abstentions are released, so which queries were answered is public).
    The worst case for a batch is that every query is answered.
    """

    sigma1: float
    threshold: float
    sigma2: float
    name: ClassVar[str] = "confident-gnmax"

    def __post_init__(self) -> None:
        if not (self.sigma1 > 0 and self.sigma2 > 0):
            raise ValueError(f"confident-gnmax: sigma1 and sigma2 must be > 0, got {self.sigma1}, {self.sigma2}")
        if not np.isfinite(self.threshold):
            raise ValueError(f"confident-gnmax: threshold must be a finite number, got {self.threshold}")

    def __call__(self, votes: np.ndarray, rng: np.random.Generator) -> MechanismResult:
        counts = check_votes(votes).astype(float)
        confident = counts.max(axis=1) + rng.normal(0.0, self.sigma1, size=len(counts)) >= self.threshold
        noisy = counts + rng.normal(0.0, self.sigma2, size=counts.shape)
        labels = np.where(confident, np.argmax(noisy, axis=1), ABSTAIN).astype(np.int64)
        return MechanismResult(labels, self._charge(len(counts), int(confident.sum())))

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        return self._charge(batch_size, batch_size)

    def _charge(self, asked: int, answered: int) -> PrivacyCharge:
        return sum_charges(
            [
                gaussian_charge(self.sigma1, count=asked, label="threshold"),
                gnmax_charge(self.sigma2, answered, label="gnmax"),
            ],
            label=self.name,
        )
