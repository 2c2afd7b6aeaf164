"""GNMax: the Gaussian noisy argmax of scalable PATE (Papernot et al., ICLR 2018), and its
variant over secure-sum vote totals (``aggregation: secure``, ``privacy.secure_votes``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting import pate
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.guarantee import Estimate
from conclave.privacy.accounting.rdp import gaussian_charge
from conclave.privacy.accounting.smooth_sensitivity import SmoothTerms, gnmax_terms
from conclave.privacy.mechanisms.base import (Description, MechanismResult, NoisedVotes, SecureVoteMechanism,
                                              VoteMechanism, parameters_of)
from conclave.privacy.mechanisms.votes import check_votes
from conclave.privacy.secure_votes import vote_release_charge


def gnmax_charge(sigma: float, count: int, label: str = "gnmax") -> PrivacyCharge:
    """``count`` GNMax answers: (λ, count·λ/σ²)-RDP (Papernot et al. 2018, Prop. 8).

    The histogram moves by 1 in two coordinates, ℓ2 sensitivity √2, so it is the Gaussian
    mechanism with noise multiplier σ/√2: λ/(2·σ²/2) = λ/σ².
    """
    return gaussian_charge(sigma / math.sqrt(2), count=count, label=label, neighbouring=Neighbouring.ONE_VOTE)


@dataclass(frozen=True)
class SecureGNMax(SecureVoteMechanism):
    """argmax of one secure round at σ: the histogram plus Skellam noise of variance σ² against any
    one owner. Per answer, Cor. 3.6 at Δ₁ = 2, Δ₂ = √2, μ = σ² (``privacy.secure_votes``): the clean
    mode's λ/σ² plus a discreteness term; the data-dependent analysis needs clean votes, so none."""

    sigma: float
    name: ClassVar[str] = "secure-gnmax"

    def __post_init__(self) -> None:
        if not self.sigma > 0:
            raise InvalidValue(f"gnmax: sigma must be > 0, got {self.sigma}")

    def answer(self, noised: NoisedVotes, batch_size: int) -> np.ndarray:
        return np.argmax(noised(np.arange(batch_size), self.sigma), axis=1).astype(np.int64)

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        return self.run_charge(batch_size, batch_size)

    def run_charge(self, asked: int, answered: int) -> PrivacyCharge:
        return vote_release_charge(self.sigma, answered, label=self.name)

    def describe(self) -> Description:
        return Description(self.name, parameters_of(self),
                           "argmax of the teachers' histogram summed through the secure sum with Skellam noise of "
                           "variance sigma^2 against any one owner",
                           "Agarwal, Kairouz & Liu 2021, Cor. 3.6 at Δ₁ = 2, Δ₂ = √2, μ = σ² per answer", bounded=True)


@dataclass(frozen=True)
class GNMax(VoteMechanism):
    """argmax_j (n_j + N(0, σ²)); data-independent charge λ/σ² per answer."""

    sigma: float
    name: ClassVar[str] = "gnmax"
    help: ClassVar[dict[str, str]] = {"sigma": "GNMax noise sigma"}
    stateless: ClassVar[bool] = True
    smooth_sensitivity_analysis: ClassVar[bool] = True
    secure_variant: ClassVar[type[SecureVoteMechanism] | None] = SecureGNMax
    noise: ClassVar[tuple[str, ...]] = ("sigma",)

    def __post_init__(self) -> None:
        if not self.sigma > 0:
            raise InvalidValue(f"gnmax: sigma must be > 0, got {self.sigma}")

    def __call__(self, votes: np.ndarray, rng: np.random.Generator) -> MechanismResult:
        counts = check_votes(votes).astype(float)
        noisy = counts + rng.normal(0.0, self.sigma, size=counts.shape)
        labels = np.argmax(noisy, axis=1).astype(np.int64)
        return MechanismResult(labels, self.worst_case_charge(len(labels)))

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        return gnmax_charge(self.sigma, batch_size, label=self.name)

    def run_charge(self, asked: int, answered: int) -> PrivacyCharge:
        return gnmax_charge(self.sigma, answered, label=self.name)

    def describe(self) -> Description:
        return Description(self.name, parameters_of(self), "argmax of the votes plus N(0, sigma^2) noise",
                           "Papernot et al. 2018, Prop. 8: (λ, λ/σ²)-RDP per answer", bounded=True)

    def data_dependent_rdp(self, votes: np.ndarray, answered: np.ndarray, orders: np.ndarray) -> np.ndarray:
        """Per-query PATE 2018 Thm 6 bound (Prop. 7's q, Prop. 10's orders), answered queries only."""
        cost = pate.gnmax_rdp(pate.gnmax_logq(votes, self.sigma), self.sigma, orders)
        return np.where(answered[:, None], cost, 0.0)

    def estimates(self, votes: np.ndarray, answered: np.ndarray, delta: float, orders: np.ndarray,
                  conversion: str) -> list[Estimate]:
        return [pate.data_dependent_estimate(self.data_dependent_rdp(votes, answered, orders), orders, delta,
                                             conversion, "Papernot et al. 2018, Thm 6 with Props. 7 and 10")]

    def smooth_sensitivity_terms(self, votes: np.ndarray, answered: np.ndarray, order: float) -> SmoothTerms:
        return gnmax_terms(votes[answered], self.sigma, order, num_teachers=int(votes.sum(axis=1).max()),
                           num_classes=votes.shape[1])
