"""The one answer to "what ε may I publish": a ``Guarantee`` that a theorem backs for every
pair of neighbouring datasets, and ``Estimate``s that are labelled as not being one.

Bases: ``renyi-filter`` (the declared budget), ``worst-case`` (work fixed in advance, RDP or
PLD) and ``unbounded``; with both a budget and a plan, the smaller ε holds. docs/privacy.md,
"What we guarantee" and "Guarantees: composition, conversion, over-charged runs".
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.filter import THEOREM as FILTER_THEOREM
from conclave.privacy.accounting.filter import RenyiFilter
from conclave.privacy.accounting.pld import THEOREM as PLD_THEOREM
from conclave.privacy.accounting.pld import pld_epsilon
from conclave.privacy.accounting.rdp import epsilon_from_rdp

WORST_CASE_THEOREM = ("data-independent worst case of the planned work: RDP composition (Mironov 2017, Prop. 1), "
                      "converted at its best order (Balle et al. 2020, Thm 21)")
CHARGED_THEOREM = ("data-independent worst case of every charge the run's ledger holds, which its plan does not "
                   "cover: RDP composition (Mironov 2017, Prop. 1), converted at its best order (Balle et al. 2020, "
                   "Thm 21)")
NOT_A_GUARANTEE = "estimate: not a DP guarantee"


@dataclass(frozen=True)
class Guarantee:
    """(ε, δ)-DP for every pair of ``neighbouring`` datasets, by ``theorem``."""

    epsilon: float
    delta: float
    basis: str  # "renyi-filter" | "worst-case" | "unbounded"
    neighbouring: Neighbouring
    theorem: str
    order: float | None = None  # the RDP order the figure comes from
    unsound_reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "neighbouring", Neighbouring.of(self.neighbouring))

    @property
    def sound(self) -> bool:
        return not self.unsound_reasons and math.isfinite(self.epsilon)

    def marked(self, reasons: tuple[str, ...]) -> Guarantee:
        """The same figure with more reasons it is not sound (e.g. reproducible noise)."""
        extra = tuple(r for r in reasons if r and r not in self.unsound_reasons)
        return Guarantee(self.epsilon, self.delta, self.basis, self.neighbouring, self.theorem, self.order,
                         self.unsound_reasons + extra)

    def as_dict(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon, "delta": self.delta, "basis": self.basis,
                "neighbouring": self.neighbouring.value, "neighbouring_means": self.neighbouring.meaning,
                "theorem": self.theorem, "order": self.order, "sound": self.sound,
                "unsound_reasons": list(self.unsound_reasons)}


@dataclass(frozen=True)
class Estimate:
    """A data-dependent or claimed figure: shown beside the guarantee, never as one.

    ``private`` estimates are computed from private data without a mechanism: they may be
    shown to the data holder (``conclave analyze``) but never leave in a run's outputs.
    """

    name: str
    epsilon: float | None
    delta: float
    source: str  # the analysis or the claim it comes from
    private: bool = False
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "epsilon": self.epsilon, "delta": self.delta, "label": NOT_A_GUARANTEE,
                "source": self.source, "private": self.private, **self.details}


def filter_guarantee(budget: RenyiFilter, neighbouring: Neighbouring) -> Guarantee:
    return Guarantee(budget.epsilon, budget.delta, "renyi-filter", neighbouring, FILTER_THEOREM, budget.order)


def worst_case_guarantee(planned: PrivacyCharge, delta: float) -> Guarantee:
    """The guarantee of work fixed in advance whose worst-case cost is ``planned``."""
    if planned.unbounded:
        return unbounded_guarantee(delta, planned.neighbouring, planned.reason)
    curve_delta = delta - planned.extra_delta
    if not curve_delta > 0:
        return unbounded_guarantee(delta, planned.neighbouring,
                                   f"the work spends δ {planned.extra_delta:g} outside its RDP curve, not below {delta:g}")
    epsilon, order = epsilon_from_rdp(planned.orders, planned.rdp, curve_delta)
    rdp = Guarantee(epsilon, delta, "worst-case", planned.neighbouring, WORST_CASE_THEOREM,
                    None if math.isnan(order) else order)
    if planned.pld is None or planned.extra_delta or not epsilon > 0:
        return rdp
    tighter = pld_epsilon(planned.pld, delta)
    return Guarantee(tighter, delta, "worst-case", planned.neighbouring, PLD_THEOREM) if tighter < epsilon else rdp


def covers(planned: PrivacyCharge, charged: PrivacyCharge) -> bool:
    """Whether the worst case of ``planned`` covers ``charged`` (what a run's ledger holds, each
    charge at its worst case): at every order, in δ outside the curves, and in boundedness."""
    if not np.array_equal(planned.orders, charged.orders) or planned.neighbouring != charged.neighbouring:
        raise InvalidValue("a run's plan and its charges must share RDP orders and the neighbouring relation")
    if planned.unbounded:
        return True
    if charged.unbounded:
        return False
    slack = 1e-9  # the same releases summed in another order
    return bool(charged.extra_delta <= planned.extra_delta * (1 + slack) + 1e-15
                and np.all(charged.rdp <= planned.rdp * (1 + slack) + 1e-12))


def run_worst_case(planned: PrivacyCharge, charged: PrivacyCharge | None) -> PrivacyCharge:
    """The worst case of the work a run did: ``planned`` where it covers ``charged`` (the run's
    ledger, every charge at its worst case), else the larger of the two at each order — never
    less than the plan — without the plan's Gaussian releases: the sequence charged was not
    fixed in advance, so their privacy-loss distribution does not apply."""
    if charged is None or covers(planned, charged):
        return planned
    unbounded = planned.unbounded or charged.unbounded
    return PrivacyCharge(planned.orders, np.maximum(planned.rdp, charged.rdp),
                         extra_delta=max(planned.extra_delta, charged.extra_delta), unbounded=unbounded,
                         reason=(planned.reason or charged.reason) if unbounded else "",
                         label="charged beyond the plan", neighbouring=planned.neighbouring)


def unbounded_guarantee(delta: float, neighbouring: Neighbouring, reason: str) -> Guarantee:
    return Guarantee(math.inf, delta, "unbounded", neighbouring, "none: " + reason, None, (reason,))


def best(*guarantees: Guarantee | None) -> Guarantee:
    """The smallest ε among guarantees of the same run at the same δ (each holds, so the minimum does)."""
    candidates = [g for g in guarantees if g is not None]
    if not candidates:
        raise InvalidValue("no guarantee to choose from")
    if len({(g.delta, g.neighbouring) for g in candidates}) != 1:
        raise InvalidValue("guarantees of one run must share δ and the neighbouring relation")
    bounded = [g for g in candidates if math.isfinite(g.epsilon)]
    if not bounded:
        return candidates[0]
    winner = min(bounded, key=lambda g: g.epsilon)
    # Reasons against soundness (reproducible noise) apply to the run, whatever the basis.
    reasons = tuple(r for g in candidates for r in g.unsound_reasons if g.basis != "unbounded")
    return winner.marked(reasons)


def run_guarantee(planned: PrivacyCharge, delta: float, budget: RenyiFilter | None = None,
                  unsound_reasons: tuple[str, ...] = (), charged: PrivacyCharge | None = None) -> Guarantee:
    """A run's guarantee: the better of its filter's budget (if it declared one; the filter holds
    whatever was charged) and the worst case of the work it did (``run_worst_case``: the plan's,
    unless ``charged``, the run's ledger at worst case, went past it), marked unsound for
    ``unsound_reasons``."""
    work = run_worst_case(planned, charged)
    worst = worst_case_guarantee(work, delta)
    if work is not planned and worst.basis == "worst-case":
        worst = dataclasses.replace(worst, theorem=CHARGED_THEOREM)
    declared = None if budget is None else filter_guarantee(budget, planned.neighbouring)
    return best(declared, worst).marked(unsound_reasons)
