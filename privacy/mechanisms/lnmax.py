"""LNMax: the Laplace noisy argmax of PATE (Papernot et al., ICLR 2017)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from privacy.accounting.charge import PrivacyCharge
from privacy.accounting.rdp import pure_epsilon_charge
from privacy.mechanisms.base import MechanismResult
from privacy.mechanisms.votes import check_votes


@dataclass(frozen=True)
class LNMax:
    """argmax_j (n_j + Lap(b)), b = ``laplace_scale`` (the paper's 1/γ).

    One teacher changing its vote moves two counts by 1, so each answer is report-noisy-max
    with Laplace noise and is (2/b, 0)-DP (Papernot et al. 2017, §3.1; Dwork & Roth 2014,
    Claim 3.9 with two moved coordinates). The charge is the pure ε₀ = 2/b per answer as RDP.
    """

    laplace_scale: float
    name: ClassVar[str] = "lnmax"

    def __post_init__(self) -> None:
        if not self.laplace_scale > 0:
            raise ValueError(f"lnmax: laplace_scale must be > 0, got {self.laplace_scale}")

    @property
    def epsilon_per_query(self) -> float:
        return 2.0 / self.laplace_scale

    def __call__(self, votes: np.ndarray, rng: np.random.Generator) -> MechanismResult:
        counts = check_votes(votes).astype(float)
        noisy = counts + rng.laplace(0.0, self.laplace_scale, size=counts.shape)
        labels = np.argmax(noisy, axis=1).astype(np.int64)
        return MechanismResult(labels, self.worst_case_charge(len(labels)))

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        return pure_epsilon_charge(self.epsilon_per_query, label=self.name, count=batch_size)
