"""The one interface every vote mechanism implements.

A mechanism sees only vote histograms ``int[batch, k]`` and a generator, and returns labels
(``ABSTAIN`` = -1) with the batch's data-independent charge on one-vote neighbours, so a refusal
reveals nothing. What configs, ``plan`` and ``analyze`` need of it are class attributes checked
at registration. Stateful mechanisms advance only on ``MechanismResult.commit()``, after the
ledger accepted the charge; ``secure_variant`` names the mechanism for ``aggregation: secure``.
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.guarantee import Estimate
from conclave.privacy.secure_votes import TEACHER_VOTES, VoteBound

ABSTAIN = -1

# (rows of the batch, σ) → int64 [rows, k]: one secure round, those queries' vote histograms summed
# with Skellam noise of variance σ² against any one owner (``privacy.secure_votes``); each call is
# a release, charged as such by whoever provides it.
NoisedVotes = Callable[[np.ndarray, float], np.ndarray]


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class MechanismResult:
    labels: np.ndarray  # int64 [batch]; ABSTAIN where no answer is released
    charge: PrivacyCharge  # data-independent cost of releasing ``labels``
    commit: Callable[[], None] = field(default=_nothing, compare=False, repr=False)


@dataclass(frozen=True)
class Description:
    """What a mechanism is, for reports and ``conclave analyze``."""

    name: str
    parameters: dict[str, Any]
    releases: str  # one line: what leaves, per query
    analysis: str  # the theorem its charge comes from
    bounded: bool  # False when no finite DP guarantee holds (NZC as published)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class VoteMechanism(abc.ABC):
    """A vote mechanism over clean histograms: a frozen dataclass whose fields are its parameters.

    ``name`` and ``help`` (one line per parameter) are required; the other class attributes and
    class methods say the rest, and their defaults suit a plain mechanism: no aliases, no secure
    variant, its worst case worked out anew for every batch, no pairing with a vote source, no
    noise for ``conclave plan`` to vary, nothing a config may leave out, no estimates.
    """

    name: ClassVar[str]  # what configs, policies and the CLI call it
    help: ClassVar[dict[str, str]]  # constructor argument → one line for ``conclave analyze --help``
    # CLI/config parameter name → constructor argument, for names that differ (e.g. sigma → sigma2)
    aliases: ClassVar[dict[str, str]] = {}
    # The class that runs this mechanism on secure-sum vote totals (``aggregation: secure``), built
    # from the same arguments; None where the mechanism needs clean histograms.
    secure_variant: ClassVar[type[SecureVoteMechanism] | None] = None
    # Whether worst_case_charge depends on the batch size alone (callers may then reuse it).
    stateless: ClassVar[bool] = False
    # Whether PATE 2018's smooth-sensitivity analysis covers it; then it also has
    # ``smooth_sensitivity_terms(votes, answered, order) -> SmoothTerms``.
    smooth_sensitivity_analysis: ClassVar[bool] = False
    # The vote source's settings its charge holds for (a kNN sample rate, the votes per record of
    # public clusters): the config's vote-source section supplies them (``actors.labeller.check_pairing``).
    paired_with: ClassVar[tuple[str, ...]] = ()
    # The parameters that set its noise: ``conclave plan`` tabulates them scaled, and warns when one
    # outweighs the votes (none: the plan shows the configured setting only).
    noise: ClassVar[tuple[str, ...]] = ()
    # What ``conclave plan`` adds when the budget admits fewer answers than planned.
    budget_note: ClassVar[str] = "abstentions cost less, so the student may get further"

    @classmethod
    def defaults(cls, votes: int) -> dict[str, float]:
        """The parameters a config may leave out, filled from the ``votes`` per query (teachers, or k)."""
        return {}

    @classmethod
    def noise_variations(cls, factors: tuple[float, ...]) -> list[tuple[tuple[str, ...], float]]:
        """The neighbouring settings ``conclave plan`` tabulates, as (parameters scaled, factor):
        every noise parameter together, at each of ``factors``."""
        return [(cls.noise, factor) for factor in factors] if cls.noise else []

    def warnings(self, teachers: int) -> list[str]:
        """Settings that defeat the mechanism with ``teachers`` votes per query (``conclave plan``):
        a noise at least the votes."""
        parameters = parameters_of(self)
        loud = [key for key in self.noise if key in parameters and parameters[key] >= teachers]
        return [f"{self.name} {key} {parameters[key]:g} is at least the {teachers} teachers: the noise outweighs "
                "even a unanimous vote's margin" for key in loud]

    @abc.abstractmethod
    def __call__(self, votes: np.ndarray, rng: np.random.Generator) -> MechanismResult:
        """Noisy answers for a batch of histograms; ``votes`` is int [batch, k], non-negative."""

    @abc.abstractmethod
    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        """The most the next batch of this size can cost, whatever the votes; the ledger checks
        this *before* the mechanism runs, so a refusal reveals nothing."""

    @abc.abstractmethod
    def run_charge(self, asked: int, answered: int) -> PrivacyCharge:
        """The data-independent charge of a whole run from a fresh state that asked ``asked``
        queries and answered ``answered`` of them (``run_charge(n, n)`` is its worst case)."""

    @abc.abstractmethod
    def describe(self) -> Description:
        ...

    def estimates(self, votes: np.ndarray, answered: np.ndarray, delta: float, orders: np.ndarray,
                  conversion: str) -> list[Estimate]:
        """Data-dependent or claimed figures for these votes (possibly none); never guarantees."""
        return []


class SecureVoteMechanism(abc.ABC):
    """A vote mechanism over noised vote totals from the secure sum (``aggregation: secure``).

    It never sees a clean histogram: ``answer`` asks for rounds (``NoisedVotes``) and turns their
    totals into labels. Its charges are data-independent, like ``VoteMechanism``'s, and the ledger
    checks ``worst_case_charge`` before the first round; whoever runs the rounds charges each
    round that completed (``actors.labeller``), which ``run_charge`` of the answers equals.
    """

    name: ClassVar[str]
    stateless: ClassVar[bool] = True  # worst_case_charge depends on the batch size only
    smooth_sensitivity_analysis: ClassVar[bool] = False  # it never sees clean votes
    paired_with: ClassVar[tuple[str, ...]] = ()  # as its clean mode's (``VoteMechanism.paired_with``)

    @property
    def vote_bound(self) -> VoteBound:
        """What one neighbour moves in a round of its vote source's histograms: each round is
        charged by it (teachers' one vote per query unless the mechanism says otherwise)."""
        return TEACHER_VOTES

    @abc.abstractmethod
    def answer(self, noised: NoisedVotes, batch_size: int) -> np.ndarray:
        """Labels int64 [batch_size] (``ABSTAIN`` where it declines), from rounds of ``noised``."""

    @abc.abstractmethod
    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        """The most a batch of this size can cost, whatever the votes."""

    @abc.abstractmethod
    def run_charge(self, asked: int, answered: int) -> PrivacyCharge:
        """The charge of a run that asked ``asked`` queries and answered ``answered``."""

    @abc.abstractmethod
    def describe(self) -> Description:
        ...


def parameters_of(mechanism: Any) -> dict[str, Any]:
    """The constructor arguments of a dataclass mechanism, as given."""
    return {f.name: getattr(mechanism, f.name) for f in dataclasses.fields(mechanism)
            if f.init and getattr(mechanism, f.name) is not None}
