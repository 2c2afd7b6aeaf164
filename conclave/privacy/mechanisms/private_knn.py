"""Private-kNN: noisy screening and noisy argmax of kNN votes over a Poisson sample of the records
(Zhu, Yu, Chandraker & Wang, "Private-kNN: Practical Differential Privacy for Computer Vision",
CVPR 2020)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.subsampled import GaussianRelease, poisson_sampled_gaussian_charge
from conclave.privacy.mechanisms.base import (ABSTAIN, Description, MechanismResult, NoisedVotes,
                                              SecureVoteMechanism, VoteMechanism, parameters_of)
from conclave.privacy.mechanisms.confident_gnmax import screened_argmax
from conclave.privacy.secure_votes import VoteBound, knn_votes

# Why one record moves at most one vote of a kNN histogram (actors.knn_votes); here, not there,
# so that configs can state it without importing Ray.
KNN_LEMMA = ("each record is one candidate neighbour: adding or removing it changes each query's k nearest "
             "sampled records by at most one entering and one leaving (or, with fewer than k sampled, one vote "
             "added or removed), so it moves at most one vote of each histogram (L2 ≤ √2, top count ±1)")


def _check(sigma1: float, threshold: float, sigma2: float, sample_rate: float) -> None:
    if not (sigma1 > 0 and sigma2 > 0):
        raise InvalidValue(f"private-knn: sigma1 and sigma2 must be > 0, got {sigma1}, {sigma2}")
    if not np.isfinite(threshold):
        raise InvalidValue(f"private-knn: threshold must be a finite number, got {threshold}")
    if not 0 < sample_rate <= 1:
        raise InvalidValue(f"private-knn: sample_rate must be in (0, 1], got {sample_rate}")


@dataclass(frozen=True)
class SecurePrivateKnn(SecureVoteMechanism):
    """Private-kNN over the owners' own kNN votes (each owner's k_o nearest sampled records, counted
    on its node) summed through the secure sum: ONE round per batch, Skellam noise of variance σ²
    (σ = sigma1 = sigma2) on every count; abstain unless the noised total's maximum reaches T, else
    its argmax. Screening and argmax read the same noised total, so the round is the whole release.

    Charge per asked query: the sampled Skellam vote release at rate q
    (``privacy.accounting.sampled_skellam``): a record added to one owner, if sampled, enters that
    owner's k_o nearest and pushes one out (the kNN lemma, per owner), so one owner's partial
    histogram, hence the total, moves by e_a − e_b, e_a or nothing."""

    sigma1: float
    threshold: float
    sigma2: float
    sample_rate: float
    name: ClassVar[str] = "secure-private-knn"
    paired_with: ClassVar[tuple[str, ...]] = ("sample_rate",)  # ``actors.labeller.check_pairing``

    def __post_init__(self) -> None:
        _check(self.sigma1, self.threshold, self.sigma2, self.sample_rate)
        if self.sigma1 != self.sigma2:
            raise InvalidValue(f"secure private-knn screens and answers on one noised total, so it has one noise: set "
                             f"sigma1 = sigma2 (got {self.sigma1:g} and {self.sigma2:g})")

    @property
    def vote_bound(self) -> VoteBound:
        return knn_votes(self.sample_rate)

    def answer(self, noised: NoisedVotes, batch_size: int) -> np.ndarray:
        totals = noised(np.arange(batch_size), self.sigma2)
        return np.where(totals.max(axis=1) >= self.threshold, np.argmax(totals, axis=1), ABSTAIN).astype(np.int64)

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        return self.run_charge(batch_size, batch_size)

    def run_charge(self, asked: int, answered: int) -> PrivacyCharge:
        """Every asked query is one sampled release, answered or not."""
        return self.vote_bound.charge(self.sigma2, asked, self.name)

    def describe(self) -> Description:
        return Description(
            self.name, parameters_of(self),
            "over each owner's k nearest records of its own Poisson sample (rate q), summed through the secure sum "
            "with Skellam noise of variance sigma^2: abstain unless the noised maximum reaches T, else its argmax",
            "sampled Skellam vote release per asked query (Agarwal, Kairouz & Liu 2021, Cor. 3.6 moments; both "
            "directions of the Poisson-sampled mixture), one record added or removed", bounded=True)


@dataclass(frozen=True)
class PrivateKnnMechanism(VoteMechanism):
    """If max_j n_j + N(0, σ1²) ≥ T answer argmax_j (n_j + N(0, σ2²)), else abstain; n is the
    histogram of the labels of the query's k nearest records among a Poisson sample at rate
    ``sample_rate`` (drawn by the vote source, fresh per query).

    Charge, per asked query, for one record added or removed (the records vote directly, no
    teacher in between): if sampled, the record enters the top k and pushes at most one out, so
    the top count moves by ≤ 1 and the histogram by ≤ √2 in ℓ2. Screening and argmax read the
    same sample, so they are charged as one sampled Gaussian release (Mironov, Talwar & Zhang
    2019) at z = (1/σ1² + 2/σ2²)^(-1/2) (``privacy.accounting.subsampled``), on every asked query:
    the two steps share the sample's randomness, so the argmax cannot be charged on answered
    queries only, as Confident-GNMax's fresh-noise steps are.

    The charge holds only for votes sampled at ``sample_rate`` by a kNN vote source
    (``actors.knn_votes.KnnVoteSource``): on teachers' histograms it would understate ε. The
    aggregator refuses any other pairing (``actors.labeller.PrivateLabeller``), and a config
    naming it needs a ``knn`` section, which sets ``sample_rate``.
    """

    sigma1: float
    threshold: float
    sigma2: float
    sample_rate: float
    name: ClassVar[str] = "private-knn"
    stateless: ClassVar[bool] = True
    # Over the owners' own kNN votes summed securely: one noised total, σ = sigma1 = sigma2.
    secure_variant: ClassVar[type[SecureVoteMechanism]] = SecurePrivateKnn
    # The vote source must sample at this rate (``actors.labeller.check_pairing``).
    paired_with: ClassVar[tuple[str, ...]] = ("sample_rate",)
    budget_note: ClassVar[str] = "every asked query costs the same, answered or not"
    help: ClassVar[dict[str, str]] = {
        "sigma1": "noise sigma of the screening of the top kNN vote count",
        "threshold": "threshold T on the noisy top kNN vote count",
        "sigma2": "noise sigma of the argmax of the kNN votes",
        "sample_rate": "probability that each private record is in a query's Poisson sample",
    }

    def __post_init__(self) -> None:
        _check(self.sigma1, self.threshold, self.sigma2, self.sample_rate)

    @property
    def releases(self) -> tuple[GaussianRelease, GaussianRelease]:
        """The two Gaussian releases on each query's sample: screening (Δ = 1), argmax (Δ₂ = √2)."""
        return GaussianRelease(self.sigma1, 1.0), GaussianRelease(self.sigma2, math.sqrt(2))

    def __call__(self, votes: np.ndarray, rng: np.random.Generator) -> MechanismResult:
        labels = screened_argmax(votes, self.sigma1, self.threshold, self.sigma2, rng)
        return MechanismResult(labels, self.run_charge(len(labels), int((labels != ABSTAIN).sum())))

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        return self.run_charge(batch_size, batch_size)

    def run_charge(self, asked: int, answered: int) -> PrivacyCharge:
        """Every asked query pays screening and argmax together, answered or not (class docstring)."""
        if not 0 <= answered <= asked:
            raise InvalidValue(f"private-knn: answered must be in [0, asked], got {answered} of {asked}")
        return poisson_sampled_gaussian_charge(self.sample_rate, self.releases, count=asked, label=self.name)

    def describe(self) -> Description:
        return Description(
            self.name, parameters_of(self),
            "over the k nearest records in a Poisson sample (rate q): abstain unless the top vote count plus "
            "N(0, sigma1^2) reaches T; then argmax of the votes plus N(0, sigma2^2)",
            "Mironov, Talwar & Zhang 2019 sampled Gaussian at z = (1/σ1² + 2/σ2²)^-1/2 per asked query (screening "
            "Δ = 1 and argmax Δ₂ = √2 on one sample), one record added or removed; Zhu et al. 2020",
            bounded=True)
