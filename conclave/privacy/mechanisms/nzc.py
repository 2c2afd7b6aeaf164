"""NZC, the "immutable noisy argmax" of Sun et al. 2019 — implemented as published, reported soundly.

Mechanism (their §3.2): add a constant c to the largest count, add Laplace(b) (or
Gaussian σ) noise to every count, release the argmax. The paper (Theorem 4) claims each
answer is (2/b, 0)-DP — "near zero cost" for huge b. That claim is not a DP guarantee:
the constant follows the plurality, so when one teacher changes its vote and flips the
plurality, two coordinates of the noised vector move by about c, not by 1. With the
paper's settings (c = 1e100, b = 1e10) the answer is the exact plurality, a deterministic
function of the votes; two histograms that differ in one teacher, (125, 125) and
(124, 126), get answers 0 and 1 with probability 1 each (in floating point exactly: a
float64 Laplace draw is below 37·b ≪ c), so no finite ε bounds it. In real arithmetic
the report-noisy-max bound with sensitivity c + 1 gives ε = 2(c + 1)/b = 2e90 at those
settings, and it grows without bound as c → ∞, the limit the paper argues for. The
paper's "distance > 2" condition is a property of the private data that is never tested
privately (the stability mechanism does that test soundly).

So the charge is ``unbounded``; the paper's claimed ε is an ``Estimate`` labelled as a
claim, always beside the sound ε = inf, never alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.guarantee import Estimate
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp, gaussian_rdp, unbounded_charge
from conclave.privacy.mechanisms.base import Description, MechanismResult, VoteMechanism, parameters_of
from conclave.privacy.mechanisms.votes import check_votes

UNSOUND_REASON = (
    "NZC adds the constant c to the plurality, so one teacher flipping the plurality moves the "
    "noised counts by ~c, not 1: no finite epsilon holds (Sun et al. 2019 Thm 4 assumes "
    "sensitivity 1 and an untested distance > 2)"
)
CLAIM_SOURCE = "Sun et al. 2019, Theorem 4 (the paper's claim, NOT a valid DP guarantee)"


@dataclass(frozen=True)
class NZC(VoteMechanism):
    """argmax_j (n_j + c·[j = j*] + noise), noise Laplace(``laplace_scale``) or N(0, ``sigma``²).

    j* is the plurality, ties broken toward the lowest class index (numpy's argmax), which
    is the paper's "current largest count". Exactly one of ``laplace_scale``/``sigma``.
    """

    constant: float
    laplace_scale: float | None = None
    sigma: float | None = None
    name: ClassVar[str] = "nzc"
    stateless: ClassVar[bool] = True
    help: ClassVar[dict[str, str]] = {
        "constant": "the constant c added to the top count",
        "laplace_scale": "Laplace scale b (the papers' 1/gamma)",
        "sigma": "Gaussian noise sigma (instead of laplace_scale)",
    }

    def __post_init__(self) -> None:
        if (self.laplace_scale is None) == (self.sigma is None):
            raise InvalidValue("nzc: give exactly one of laplace_scale or sigma (Laplace or Gaussian noise)")
        scale = self.laplace_scale if self.sigma is None else self.sigma
        if not scale > 0:
            raise InvalidValue(f"nzc: noise scale must be > 0, got {scale}")
        if not (self.constant >= 0 and math.isfinite(self.constant)):
            raise InvalidValue(f"nzc: constant must be a finite number >= 0, got {self.constant}")

    def __call__(self, votes: np.ndarray, rng: np.random.Generator) -> MechanismResult:
        counts = check_votes(votes).astype(float)
        rows = np.arange(len(counts))
        counts[rows, np.argmax(counts, axis=1)] += self.constant
        if self.laplace_scale is not None:
            noise = rng.laplace(0.0, self.laplace_scale, size=counts.shape)
        else:
            noise = rng.normal(0.0, self.sigma, size=counts.shape)
        labels = np.argmax(counts + noise, axis=1).astype(np.int64)
        return MechanismResult(labels, self.worst_case_charge(len(labels)))

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        return unbounded_charge(UNSOUND_REASON, label=self.name, neighbouring=Neighbouring.ONE_VOTE)

    def run_charge(self, asked: int, answered: int) -> PrivacyCharge:
        return self.worst_case_charge(asked)

    def describe(self) -> Description:
        return Description(self.name, parameters_of(self),
                           "argmax of the votes with c added to the plurality, plus noise (as published)",
                           "none: " + UNSOUND_REASON, bounded=False)

    def claimed_epsilon(self, queries: int, delta: float) -> float:
        """The ε the paper would publish for ``queries`` answers — a claim, not a guarantee.

        Laplace: Theorem 4's 2/b per answer, composed over T answers as the paper does
        (Dwork & Roth advanced composition: 4Tγ² + 2γ·sqrt(2T·log(1/δ)), γ = 1/b), or
        T·2γ when that is smaller. Gaussian: the paper defers to PATE 2018, i.e. GNMax's
        T·λ/σ² RDP converted with the classic conversion.
        """
        if queries <= 0:
            return 0.0
        if self.laplace_scale is not None:
            gamma = 1.0 / self.laplace_scale
            advanced = 4 * queries * gamma**2 + 2 * gamma * math.sqrt(2 * queries * math.log(1 / delta))
            return min(2 * gamma * queries, advanced)
        rdp = queries * gaussian_rdp(DEFAULT_ORDERS, self.sigma / math.sqrt(2))
        return epsilon_from_rdp(DEFAULT_ORDERS, rdp, delta, conversion="classic")[0]

    def estimates(self, votes: np.ndarray, answered: np.ndarray, delta: float, orders: np.ndarray,
                  conversion: str) -> list[Estimate]:
        count = int(answered.sum())
        per_query = 2.0 / self.laplace_scale if self.laplace_scale is not None else None
        return [Estimate("paper-claim", self.claimed_epsilon(count, delta), delta, CLAIM_SOURCE,
                         details={"epsilon_per_query": per_query, "queries": count, "why_not": UNSOUND_REASON})]
