"""GNMax: the Gaussian noisy argmax of scalable PATE (Papernot et al., ICLR 2018)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from privacy.accounting.charge import PrivacyCharge
from privacy.accounting.rdp import gaussian_charge
from privacy.mechanisms.base import MechanismResult
from privacy.mechanisms.votes import check_votes


def gnmax_charge(sigma: float, count: int, label: str = "gnmax") -> PrivacyCharge:
    """``count`` GNMax answers: (λ, count·λ/σ²)-RDP (Papernot et al. 2018, Prop. 8).

    The histogram moves by 1 in two coordinates, ℓ2 sensitivity √2, so it is the Gaussian
    mechanism with noise multiplier σ/√2: λ/(2·σ²/2) = λ/σ².
    """
    return gaussian_charge(sigma / math.sqrt(2), count=count, label=label)


@dataclass(frozen=True)
class GNMax:
    """argmax_j (n_j + N(0, σ²)); data-independent charge λ/σ² per answer."""

    sigma: float
    name: ClassVar[str] = "gnmax"

    def __post_init__(self) -> None:
        if not self.sigma > 0:
            raise ValueError(f"gnmax: sigma must be > 0, got {self.sigma}")

    def __call__(self, votes: np.ndarray, rng: np.random.Generator) -> MechanismResult:
        counts = check_votes(votes).astype(float)
        noisy = counts + rng.normal(0.0, self.sigma, size=counts.shape)
        labels = np.argmax(noisy, axis=1).astype(np.int64)
        return MechanismResult(labels, self.worst_case_charge(len(labels)))

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        return gnmax_charge(self.sigma, batch_size, label=self.name)
