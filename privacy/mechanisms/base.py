"""The one interface every vote mechanism implements.

A mechanism sees only vote histograms ``int[batch, k]`` (never teachers or inputs) and a
random generator, and returns labels (``ABSTAIN`` = -1 where it declines to answer) plus
the data-independent privacy charge of the batch. Gating the ledger on data-independent
charges keeps the refusal decision itself free of private information; data-dependent
analyses live in ``privacy.accounting`` and are published only through smooth sensitivity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from privacy.accounting.charge import PrivacyCharge

ABSTAIN = -1


@dataclass(frozen=True)
class MechanismResult:
    labels: np.ndarray  # int64 [batch]; ABSTAIN where no answer is released
    charge: PrivacyCharge  # data-independent cost of releasing ``labels``


class VoteMechanism(Protocol):
    name: str

    def __call__(self, votes: np.ndarray, rng: np.random.Generator) -> MechanismResult:
        """Noisy answers for a batch of histograms; ``votes`` is int [batch, k], non-negative."""
        ...

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        """The most a batch of this size can cost, whatever the votes; the ledger checks this
        against the limit *before* the mechanism runs, so a refusal reveals nothing."""
        ...
