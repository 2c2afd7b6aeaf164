"""What a ledger's charges compose to: their running sums, the filter's verdict on a new charge,
and the report of what was spent.

The math of a ledger, apart from its state (as dp_accounting and Opacus keep an accountant's math
apart from what it is charged to): a ``PrivacyLedger`` adds each charge here once it is committed,
and ``read_ledger`` rebuilds the same sums from a file, in row-id order, bit for bit.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter
from conclave.privacy.accounting.guarantee import Guarantee, filter_guarantee
from conclave.privacy.accounting.ledger_format import BudgetChange, StoredCharge, WorstCase
from conclave.privacy.accounting.pld import GaussianSteps
from conclave.privacy.accounting.rdp import epsilon_from_rdp


@dataclass(frozen=True)
class BudgetReport:
    """What a ledger holds now. ``epsilon_spent`` composes the charges at their best order with the
    tight conversion (Balle et al. 2020, Thm 21) at δ − Σ extra δ: a function of what was
    released, so it may be shown, but an odometer reading, not the guarantee (``guarantee``)."""

    epsilon_spent: float  # realised spend at its best order (inf once an unbounded charge was accepted)
    delta: float  # total δ: curve δ + Σ extra δ (= the configured δ)
    order: float | None  # RDP order attaining epsilon_spent; None when nothing or something unbounded was spent
    charges: int
    bounded: bool  # False once an unbounded charge (e.g. NZC) has been recorded
    by_label: dict[str, float]  # ε each label would cost alone, at the same δ split
    neighbouring: Neighbouring
    budget: RenyiFilter | None  # None: a record-only ledger
    rdp_at_budget_order: float | None  # the filter's running sum (None without a budget)
    extra_delta: float  # δ spent outside RDP curves so far
    changes: tuple[BudgetChange, ...] = ()  # the budget's changes since it was declared, in order

    @property
    def epsilon_limit(self) -> float:
        """The budget's ε now (inf for a record-only ledger)."""
        return self.budget.epsilon if self.budget is not None else math.inf

    @property
    def guarantee(self) -> Guarantee | None:
        """The filter's guarantee — at the largest budget it ever declared — or None without a
        budget (the run's planned work must give one)."""
        largest = largest_budget(self.budget, self.changes)
        return None if largest is None else filter_guarantee(largest, self.neighbouring)

    @property
    def remaining_rdp(self) -> float | None:
        """What the filter still admits at its order (None without a budget)."""
        if self.budget is None or self.rdp_at_budget_order is None:
            return None
        return max(0.0, self.budget.rdp_budget - self.rdp_at_budget_order)



def current_budget(declared: RenyiFilter | None, changes: tuple[BudgetChange, ...] | list[BudgetChange]
                   ) -> RenyiFilter | None:
    """The limit in force: the budget declared at creation, with its latest change's ε."""
    if declared is None or not changes:
        return declared
    return dataclasses.replace(declared, epsilon=changes[-1].epsilon)


def largest_budget(budget: RenyiFilter | None, changes: tuple[BudgetChange, ...]) -> RenyiFilter | None:
    """The largest budget a ledger ever declared (``budget`` being the one now): its guarantee."""
    if budget is None or not changes:
        return budget
    return dataclasses.replace(budget, epsilon=max(budget.epsilon, *(c.previous for c in changes)))


# --- reading a ledger file without writing it ----------------------------------------------


class LedgerTotals:
    """Running sums of the charges read so far on ``orders``, always added in row-id order so that
    a reopened ledger rebuilds bit-identical totals, and what they compose to at the ledger's
    ``delta`` for its ``neighbouring`` relation."""

    def __init__(self, orders: np.ndarray, delta: float, neighbouring: Neighbouring) -> None:
        self.orders, self.delta, self.neighbouring = orders, delta, neighbouring
        self.count = 0
        self.rdp = np.zeros(orders.size)
        self.extra_delta = 0.0
        self.unbounded = False
        self.by_label: dict[str, tuple[np.ndarray, float, bool]] = {}
        # The Gaussian releases of every charge so far, while each was one (``PrivacyCharge.pld``).
        self.plan: tuple[GaussianSteps, ...] | None = ()
        # Every charge at the worst case it was checked against (its own where none was given).
        self.worst = WorstCase(np.zeros(orders.size), 0.0, False)
        self._report: tuple[tuple[int, int], BudgetReport] | None = None  # the last report, by entries it covers

    def add(self, charge: StoredCharge) -> None:
        self.count += 1
        worst = charge.worst
        if worst is None:  # the charge is its own worst case
            worst = WorstCase(charge.rdp, charge.extra_delta, charge.unbounded)
        self.worst = WorstCase(self.worst.rdp + worst.rdp, self.worst.extra_delta + worst.extra_delta,
                               self.worst.unbounded or worst.unbounded)
        self.plan = None if self.plan is None or charge.plan is None else self.plan + charge.plan
        self.rdp = self.rdp + charge.rdp
        self.extra_delta += charge.extra_delta
        self.unbounded = self.unbounded or charge.unbounded
        curve, extra, unb = self.by_label.get(charge.label, (np.zeros_like(charge.rdp), 0.0, False))
        self.by_label[charge.label] = (curve + charge.rdp, extra + charge.extra_delta, unb or charge.unbounded)

    def spent(self) -> PrivacyCharge:
        """Everything added so far as one composed charge (curve, Σ extra δ, unbounded)."""
        return self._composed(self.rdp.copy(), self.extra_delta, self.unbounded, "spent",
                              self.plan if self.count else None)

    def worst_case(self) -> PrivacyCharge:
        """Every charge added so far at the worst case it was checked against (its own where none
        was given), composed."""
        worst = self.worst
        return self._composed(worst.rdp.copy(), worst.extra_delta, worst.unbounded, "charged at worst case")

    def label_charges(self) -> dict[str, PrivacyCharge]:
        """Each label's charges composed."""
        return {label: self._composed(*sums, label) for label, sums in self.by_label.items()}

    def refusal(self, budget: RenyiFilter | None, budget_index: int | None, charge: PrivacyCharge) -> str | None:
        """The filter's verdict on ``charge`` after what was spent (None without a budget);
        ``budget_index``: the budget's order on ``orders``."""
        if budget is None:
            return None
        return budget.refusal(self.rdp[budget_index], self.extra_delta, charge)

    def report(self, budget: RenyiFilter | None, budget_index: int | None,
               changes: tuple[BudgetChange, ...]) -> BudgetReport:
        """The report for the entries so far (charges and budget ``changes``); computed once per
        new entry (the conversions to ε are most of a read's cost, and a label call reads the
        budget several times)."""
        entries = (self.count, len(changes))
        if self._report is not None and self._report[0] == entries:
            return self._report[1]
        epsilon, order = self._epsilon(self.rdp, self.extra_delta, self.unbounded)
        if len(self.by_label) == 1:  # the one label's sums are the totals, bit for bit
            by_label = dict.fromkeys(self.by_label, epsilon)
        else:
            by_label = {
                label: self._epsilon(curve, extra, unbounded)[0]
                for label, (curve, extra, unbounded) in self.by_label.items()
            }
        report = BudgetReport(
            epsilon_spent=epsilon,
            delta=self.delta,
            order=order,
            charges=self.count,
            bounded=not self.unbounded,
            by_label=by_label,
            neighbouring=self.neighbouring,
            budget=budget,
            rdp_at_budget_order=None if budget_index is None else float(self.rdp[budget_index]),
            extra_delta=self.extra_delta,
            changes=changes,
        )
        self._report = (entries, report)
        return report

    def _epsilon(self, rdp: np.ndarray, extra_delta: float, unbounded: bool) -> tuple[float, float | None]:
        if unbounded or extra_delta >= self.delta:
            return math.inf, None
        epsilon, order = epsilon_from_rdp(self.orders, rdp, self.delta - extra_delta, conversion="tight")
        return epsilon, (None if math.isnan(order) else order)

    def _composed(self, rdp: np.ndarray, extra_delta: float, unbounded: bool, label: str,
                  plan: tuple[GaussianSteps, ...] | None = None) -> PrivacyCharge:
        return PrivacyCharge(self.orders, rdp, extra_delta=extra_delta, unbounded=unbounded,
                             reason="an unbounded charge was recorded" if unbounded else "", label=label,
                             neighbouring=self.neighbouring, pld=plan)
