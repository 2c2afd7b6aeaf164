"""Confident-GNMax: answer only when the teachers agree strongly (Papernot et al., ICLR 2018), and
its variant over secure-sum vote totals (``aggregation: secure``, ``privacy.secure_votes``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting import pate
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.guarantee import Estimate
from conclave.privacy.accounting.rdp import gaussian_charge, sum_charges
from conclave.privacy.accounting.smooth_sensitivity import SmoothTerms, gnmax_terms, threshold_terms
from conclave.privacy.mechanisms.base import (ABSTAIN, Description, MechanismResult, NoisedVotes,
                                              SecureVoteMechanism, VoteMechanism, parameters_of)
from conclave.privacy.mechanisms.gnmax import gnmax_charge
from conclave.privacy.mechanisms.votes import check_votes
from conclave.privacy.secure_votes import vote_release_charge

# The threshold T when a config leaves it out, as a share of the votes per query n. The test
# passes when the top count plus N(0, σ1²) reaches T: at 0.6 n a unanimous vote passes with
# probability Φ(0.4 n/σ1), a 60% plurality half the time. The demo's T = 30 of 50 (σ1 = 20 =
# 0.4 n: 84% for a unanimous vote); Papernot et al. 2018 used 200 of 250 on MNIST (0.8, σ1 =
# 150) and 300 of 250 on SVHN, where many queries abstain by design.
THRESHOLD_SHARE = 0.6
THRESHOLD_TOO_HIGH = 0.9  # T at this share of the teachers or more: almost every query abstains
THRESHOLD_TOO_LOW = 0.3  # ... below this share the threshold screens out little


def _check(sigma1: float, threshold: float, sigma2: float) -> None:
    if not (sigma1 > 0 and sigma2 > 0):
        raise InvalidValue(f"confident-gnmax: sigma1 and sigma2 must be > 0, got {sigma1}, {sigma2}")
    if not np.isfinite(threshold):
        raise InvalidValue(f"confident-gnmax: threshold must be a finite number, got {threshold}")


@dataclass(frozen=True)
class SecureConfidentGNMax(SecureVoteMechanism):
    """Two secure rounds: the whole batch at σ1, then the argmax of a second round at σ2 on the
    queries whose noised histogram has a maximum ≥ T (abstain on the rest).

    The test is on the *maximum of the noised histogram* — every count gets its own noise — not on
    the clean mode's top count plus one draw: nobody holds the clean top count. The maximum of k
    noisy counts sits above the noisy top count, so more queries pass a given T than in the clean
    mode. Which queries pass is released anyway (the abstentions), so round 2 asks only for those.

    Charge: Cor. 3.6 at Δ₁ = 2, Δ₂ = √2 for every asked query at μ = σ1² and every answered one
    at μ = σ2² (``privacy.secure_votes``). The threshold step releases a whole histogram (ℓ2
    sensitivity √2) where the clean mode releases its maximum (sensitivity 1): about twice the
    clean threshold's λ/(2σ1²) at the same σ1. The worst case is every query answered.
    """

    sigma1: float
    threshold: float
    sigma2: float
    name: ClassVar[str] = "secure-confident-gnmax"

    def __post_init__(self) -> None:
        _check(self.sigma1, self.threshold, self.sigma2)

    def answer(self, noised: NoisedVotes, batch_size: int) -> np.ndarray:
        confident = np.flatnonzero(noised(np.arange(batch_size), self.sigma1).max(axis=1) >= self.threshold)
        labels = np.full(batch_size, ABSTAIN, dtype=np.int64)
        if confident.size:
            labels[confident] = np.argmax(noised(confident, self.sigma2), axis=1)
        return labels

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        return self.run_charge(batch_size, batch_size)

    def run_charge(self, asked: int, answered: int) -> PrivacyCharge:
        return sum_charges([vote_release_charge(self.sigma1, asked, label="threshold"),
                            vote_release_charge(self.sigma2, answered, label="gnmax")], label=self.name)

    def describe(self) -> Description:
        return Description(
            self.name, parameters_of(self),
            "abstain unless the maximum of the histogram plus Skellam noise of variance sigma1^2 (secure sum) reaches "
            "T; then argmax of the histogram plus Skellam noise of variance sigma2^2",
            "Agarwal, Kairouz & Liu 2021, Cor. 3.6 at Δ₁ = 2, Δ₂ = √2: μ = σ1² per query, μ = σ2² per answer",
            bounded=True)


def screened_argmax(votes: np.ndarray, sigma1: float, threshold: float, sigma2: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Labels: argmax_j (n_j + N(0, σ2²)) where max_j n_j + N(0, σ1²) ≥ T, else ``ABSTAIN``
    (Confident-GNMax's release; Private-kNN's too, on kNN votes)."""
    counts = check_votes(votes).astype(float)
    confident = counts.max(axis=1) + rng.normal(0.0, sigma1, size=len(counts)) >= threshold
    noisy = counts + rng.normal(0.0, sigma2, size=counts.shape)
    return np.where(confident, np.argmax(noisy, axis=1), ABSTAIN).astype(np.int64)


@dataclass(frozen=True)
class ConfidentGNMax(VoteMechanism):
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
    stateless: ClassVar[bool] = True
    smooth_sensitivity_analysis: ClassVar[bool] = True
    # the CLI's --sigma is σ2 for confident-gnmax (the GNMax step after the threshold)
    aliases: ClassVar[dict[str, str]] = {"sigma": "sigma2"}
    secure_variant: ClassVar[type[SecureVoteMechanism] | None] = SecureConfidentGNMax
    help: ClassVar[dict[str, str]] = {
        "sigma1": "noise sigma of the threshold check",
        "threshold": "threshold T on the top count",
        "sigma2": "GNMax noise sigma after the threshold",
    }
    noise: ClassVar[tuple[str, ...]] = ("sigma1", "sigma2")

    def __post_init__(self) -> None:
        _check(self.sigma1, self.threshold, self.sigma2)

    @classmethod
    def defaults(cls, votes: int) -> dict[str, float]:
        return {"threshold": THRESHOLD_SHARE * votes}

    @classmethod
    def noise_variations(cls, factors: tuple[float, ...]) -> list[tuple[tuple[str, ...], float]]:
        """Both σ's down and up, then each alone up: which one buys answers (``factors`` aside)."""
        return [(("sigma1", "sigma2"), 0.75), (("sigma1", "sigma2"), 2.0), (("sigma1",), 1.5), (("sigma2",), 1.5)]

    def warnings(self, teachers: int) -> list[str]:
        """A threshold the ensemble can hardly reach, or one that screens out little; then the noise's."""
        unanimous = 0.5 * (1 + math.erf((teachers - self.threshold) / self.sigma1 / math.sqrt(2)))
        share = self.threshold / teachers
        screening = []
        if self.threshold >= THRESHOLD_TOO_HIGH * teachers:
            screening.append(f"{self.name} threshold {self.threshold:g} is {share:.0%} of the {teachers} teachers: "
                             f"even a unanimous vote passes only {unanimous:.0%} of the time, so most queries "
                             f"abstain (left out, the threshold is {THRESHOLD_SHARE:g} × the teachers)")
        elif self.threshold < THRESHOLD_TOO_LOW * teachers:
            screening.append(f"{self.name} threshold {self.threshold:g} is only {share:.0%} of the {teachers} "
                             "teachers: weak pluralities pass too, so it screens out little")
        return screening + super().warnings(teachers)

    def __call__(self, votes: np.ndarray, rng: np.random.Generator) -> MechanismResult:
        labels = screened_argmax(votes, self.sigma1, self.threshold, self.sigma2, rng)
        return MechanismResult(labels, self.run_charge(len(labels), int((labels != ABSTAIN).sum())))

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        return self.run_charge(batch_size, batch_size)

    def run_charge(self, asked: int, answered: int) -> PrivacyCharge:
        return sum_charges(
            [
                gaussian_charge(self.sigma1, count=asked, label="threshold", neighbouring=Neighbouring.ONE_VOTE),
                gnmax_charge(self.sigma2, answered, label="gnmax"),
            ],
            label=self.name,
        )

    def describe(self) -> Description:
        return Description(
            self.name, parameters_of(self),
            "abstain unless the top count plus N(0, sigma1^2) reaches T; then argmax plus N(0, sigma2^2)",
            "Papernot et al. 2018, Prop. 8: λ/(2σ1²) per query for the threshold, λ/σ2² per answer", bounded=True)

    def data_dependent_rdp(self, votes: np.ndarray, answered: np.ndarray, orders: np.ndarray) -> np.ndarray:
        """Per query: the threshold step's Thm 6 bound at √2·σ1, plus GNMax's on answered queries."""
        threshold = pate.threshold_rdp(pate.threshold_logq(votes, self.threshold, self.sigma1), self.sigma1, orders)
        gnmax = pate.gnmax_rdp(pate.gnmax_logq(votes, self.sigma2), self.sigma2, orders)
        return threshold + np.where(answered[:, None], gnmax, 0.0)

    def estimates(self, votes: np.ndarray, answered: np.ndarray, delta: float, orders: np.ndarray,
                  conversion: str) -> list[Estimate]:
        return [pate.data_dependent_estimate(self.data_dependent_rdp(votes, answered, orders), orders, delta,
                                             conversion, "Papernot et al. 2018, Thm 6 (threshold at √2·σ1, GNMax at σ2)")]

    def smooth_sensitivity_terms(self, votes: np.ndarray, answered: np.ndarray, order: float) -> SmoothTerms:
        teachers = int(votes.sum(axis=1).max())
        return gnmax_terms(votes[answered], self.sigma2, order, teachers, votes.shape[1]) + threshold_terms(
            votes, self.threshold, self.sigma1, order, teachers)
