"""A vote mechanism that ships nowhere: one file, made known with one line
(``privacy.mechanisms.register(ToyMax)``). What configs, ``conclave plan``, ``run`` and ``serve``
need of it comes from the class (tests/cluster/test_toy_mechanism.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.rdp import gaussian_charge
from conclave.privacy.mechanisms.base import ABSTAIN, Description, MechanismResult, VoteMechanism, parameters_of
from conclave.privacy.mechanisms.votes import check_votes


@dataclass(frozen=True)
class ToyMax(VoteMechanism):
    """The histogram plus N(0, σ²) on every count, released once per asked query (one vote moves
    it by √2 in ℓ2: the Gaussian mechanism, Mironov 2017, Prop. 7); the label is its argmax where
    its top count reaches ``floor``, else an abstention — post-processing, so an abstention costs
    as much as an answer."""

    sigma: float
    floor: float
    name: ClassVar[str] = "toy-max"
    help: ClassVar[dict[str, str]] = {"sigma": "noise sigma on every count",
                                      "floor": "abstain where the noised top count stays under this"}
    stateless: ClassVar[bool] = True
    noise: ClassVar[tuple[str, ...]] = ("sigma",)
    budget_note: ClassVar[str] = "an abstention costs as much as an answer"

    @classmethod
    def defaults(cls, votes: int) -> dict[str, float]:
        return {"floor": votes / 2}

    def __call__(self, votes: np.ndarray, rng: np.random.Generator) -> MechanismResult:
        counts = check_votes(votes).astype(float)
        noised = counts + rng.normal(0.0, self.sigma, size=counts.shape)
        labels = np.where(noised.max(axis=1) >= self.floor, np.argmax(noised, axis=1), ABSTAIN).astype(np.int64)
        return MechanismResult(labels, self.worst_case_charge(len(labels)))

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        return self.run_charge(batch_size, batch_size)

    def run_charge(self, asked: int, answered: int) -> PrivacyCharge:
        return gaussian_charge(self.sigma / math.sqrt(2), count=asked, label=self.name,
                               neighbouring=Neighbouring.ONE_VOTE)

    def describe(self) -> Description:
        return Description(self.name, parameters_of(self),
                           "argmax of the votes plus N(0, sigma^2) where the noised top count reaches the floor",
                           "Gaussian mechanism at ℓ2 sensitivity √2 (Mironov 2017, Prop. 7) per asked query",
                           bounded=True)
