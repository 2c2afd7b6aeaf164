"""An owner's lifetime Rényi ledger on its machine: every release from its data, in every run.

Every release from the owner's data, in any run, is charged here first, by its gateway: a Rényi
filter across runs at the order fixed when the file is created (Feldman & Zrnic 2021, Thm 3.1). The
terms come from the owner's policy (``owner_policy``), the data's fingerprint from
``data_fingerprint``. docs/privacy.md, "An owner's lifetime budget".
"""
from __future__ import annotations

import dataclasses

import numpy as np

from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.data_fingerprint import data_fingerprint
from conclave.privacy.accounting.filter import RenyiFilter, order_index, rdp_budget
from conclave.privacy.accounting.ledger import BudgetExceeded, BudgetReport, PrivacyLedger
from conclave.privacy.accounting.owner_policy import OwnerRefused, OwnerTerms



class OwnerLedger:
    """One owner's lifetime ledger, on the owner's machine, open for one run under the ``terms`` its
    gateway admitted (``owner_policy.OwnerAdmission``): a ``Ledger`` whose refusals name the owner
    and whose charges carry the run's name and the fingerprint of the owner's files. Made by ``open``."""

    def __init__(self, terms: OwnerTerms, ledger: PrivacyLedger, cap: float | None, run: str,
                 fingerprint: str) -> None:
        self.owner, self.terms, self.path = terms.owner, terms, ledger.path
        self._ledger = ledger
        self._cap = cap  # the lower lifetime ε this run asked to stay within
        self._run, self._fingerprint = run, fingerprint
        self.last_refusal: str | None = None  # the latest refusal's line

    @classmethod
    def open(cls, terms: OwnerTerms, planned: PrivacyCharge, run: str,
             data_paths: tuple[str, ...] = ()) -> OwnerLedger:
        """The owner's ledger (created, with the lifetime filter fixed from ``planned``, when it has
        no file yet) open for ``run``; ``data_paths``: the owner's files, whose fingerprint goes with
        each charge. A file whose budget is not the one in force is refused: a lifetime budget
        changes only by its owner, on its machine (``owner_policy.change_budget``)."""
        budget, owner = terms.budget, terms.owner
        if planned.neighbouring != budget.neighbouring:
            raise OwnerRefused(f"owner {owner}: its budget is for {budget.neighbouring} neighbours, the run's "
                               f"releases are bounded for {planned.neighbouring}")
        path = budget.ledger_path(owner)  # resolved here, on the owner's machine
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            ledger = PrivacyLedger.open_existing(path, keep_record=True)
            try:
                cap = terms.cap_within(ledger.budget, path)
            except BaseException:
                ledger.close()
                raise
        else:
            ledger = PrivacyLedger(path, budget.delta, budget.filter(planned), neighbouring=budget.neighbouring,
                                   keep_record=True)
            cap = terms.cap
        return cls(terms, ledger, cap, run, data_fingerprint(owner, path, data_paths))

    # --- the Ledger protocol (``privacy.accounting.ledger``) -----------------------------------

    @property
    def delta(self) -> float:
        return self._ledger.delta

    @property
    def neighbouring(self) -> Neighbouring:
        return self._ledger.neighbouring

    @property
    def orders(self) -> np.ndarray:
        return self._ledger.orders

    @property
    def budget(self) -> RenyiFilter | None:
        return self._ledger.budget

    def refusal(self, charge: PrivacyCharge) -> str | None:
        """None when ``charge`` fits the lifetime budget now (and the run's lower cap), else the
        refusal in one line naming the owner and what its lifetime budget has left."""
        refused = _cap_refusal(self.owner, self._cap, self._ledger, charge)
        if refused is None and not self._ledger.can_afford(charge):
            refused = _refusal_line(self.owner, self._ledger.report())
        if refused is not None:
            self.last_refusal = refused
        return refused

    def can_afford(self, charge: PrivacyCharge) -> bool:
        return self.refusal(charge) is None

    def charge(self, charge: PrivacyCharge, worst_case: PrivacyCharge | None = None) -> BudgetReport:
        """Record ``charge`` durably, tagged with the run and the data's fingerprint, or raise
        ``BudgetExceeded`` with the refusal in one line (naming the owner and what its lifetime
        budget has left) when spent + ``worst_case`` would pass the budget — nothing is
        recorded then. (The owner's gateway answers the coordinator with the line:
        ``cluster.gateway.vote_runs``, ``cluster.gateway.dpsgd_runs``.)"""
        capped = _cap_refusal(self.owner, self._cap, self._ledger, worst_case if worst_case is not None else charge)
        if capped is not None:
            self.last_refusal = capped
            raise BudgetExceeded(capped)
        tagged = dataclasses.replace(charge, details={**charge.details, "run": self._run,
                                                      "fingerprint": self._fingerprint})
        try:
            return self._ledger.charge(tagged, worst_case=worst_case)
        except BudgetExceeded:
            self.last_refusal = _refusal_line(self.owner, self._ledger.report())
            raise BudgetExceeded(self.last_refusal) from None

    def report(self) -> BudgetReport:
        return self._ledger.report()

    def spent(self) -> PrivacyCharge:
        return self._ledger.spent()

    def close(self) -> None:
        self._ledger.close()


def _cap_refusal(owner: str, cap: float | None, ledger: PrivacyLedger, charge: PrivacyCharge) -> str | None:
    """The refusal of ``charge`` by the lower lifetime ε ``cap`` a run asked for, or None."""
    if cap is None:
        return None
    report = ledger.report()
    budget = report.budget
    allowed = max(0.0, rdp_budget(cap, budget.curve_delta, budget.order))
    if report.rdp_at_budget_order + charge.rdp[order_index(budget.order, charge.orders)] <= allowed * (1 + 1e-12):
        return None
    left = max(0.0, allowed - report.rdp_at_budget_order)
    return (f"owner {owner}'s lifetime budget, kept within ε {cap:g} of its ε {budget.epsilon:g} as "
            f"this run asks, refuses it: {left:.4g} of {allowed:.4g} left at Rényi order {budget.order:g} (spent "
            f"so far ε {report.epsilon_spent:.4g}, {report.charges} charges)")


def _refusal_line(owner: str, report: BudgetReport) -> str:
    """One line: whose lifetime budget refuses, and what it has left."""
    left = report.remaining_rdp
    return (f"owner {owner}'s lifetime budget ε {report.epsilon_limit:g} at δ {report.delta:g} refuses it: "
            f"{left:.4g} of {report.budget.rdp_budget:.4g} left at Rényi order {report.budget.order:g} "
            f"(spent so far ε {report.epsilon_spent:.4g}, {report.charges} charges)")
