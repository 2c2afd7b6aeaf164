"""LNMax: the Laplace noisy argmax of PATE (Papernot et al., ICLR 2017)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting import pate
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.guarantee import Estimate
from conclave.privacy.accounting.rdp import pure_epsilon_charge
from conclave.privacy.mechanisms.base import Description, MechanismResult, VoteMechanism, parameters_of
from conclave.privacy.mechanisms.votes import check_votes


@dataclass(frozen=True)
class LNMax(VoteMechanism):
    """argmax_j (n_j + Lap(b)), b = ``laplace_scale`` (the paper's 1/γ).

    One teacher changing its vote moves two counts by 1, so each answer is report-noisy-max
    with Laplace noise and is (2/b, 0)-DP (Papernot et al. 2017, §3.1; Dwork & Roth 2014,
    Claim 3.9 with two moved coordinates). The charge is the pure ε₀ = 2/b per answer as RDP.
    """

    laplace_scale: float
    name: ClassVar[str] = "lnmax"
    help: ClassVar[dict[str, str]] = {"laplace_scale": "Laplace scale b (the papers' 1/gamma)"}
    stateless: ClassVar[bool] = True
    noise: ClassVar[tuple[str, ...]] = ("laplace_scale",)

    def __post_init__(self) -> None:
        if not self.laplace_scale > 0:
            raise InvalidValue(f"lnmax: laplace_scale must be > 0, got {self.laplace_scale}")

    @property
    def epsilon_per_query(self) -> float:
        return 2.0 / self.laplace_scale

    def __call__(self, votes: np.ndarray, rng: np.random.Generator) -> MechanismResult:
        counts = check_votes(votes).astype(float)
        noisy = counts + rng.laplace(0.0, self.laplace_scale, size=counts.shape)
        labels = np.argmax(noisy, axis=1).astype(np.int64)
        return MechanismResult(labels, self.worst_case_charge(len(labels)))

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        return self.run_charge(batch_size, batch_size)

    def run_charge(self, asked: int, answered: int) -> PrivacyCharge:
        return pure_epsilon_charge(self.epsilon_per_query, label=self.name, count=answered,
                                   neighbouring=Neighbouring.ONE_VOTE)

    def describe(self) -> Description:
        return Description(self.name, parameters_of(self), "argmax of the votes plus Laplace(b) noise",
                           "Papernot et al. 2017, §3.1: (2/b, 0)-DP per answer, as RDP min(ε₀, λε₀²/2)",
                           bounded=True)

    def data_dependent_rdp(self, votes: np.ndarray, answered: np.ndarray, orders: np.ndarray) -> np.ndarray:
        """Per-query PATE 2017 Thm 3 bound with Lemma 4's q, answered queries only."""
        cost = pate.lnmax_rdp(pate.lnmax_logq(votes, self.laplace_scale), self.laplace_scale, orders)
        return np.where(answered[:, None], cost, 0.0)

    def estimates(self, votes: np.ndarray, answered: np.ndarray, delta: float, orders: np.ndarray,
                  conversion: str) -> list[Estimate]:
        return [pate.data_dependent_estimate(self.data_dependent_rdp(votes, answered, orders), orders, delta,
                                             conversion, "Papernot et al. 2017, Thm 3 with Lemma 4")]
