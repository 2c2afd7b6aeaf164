"""What several published runs on the same private data guarantee together.

Each run is bounded at every Rényi order by the worst case of the work it planned (public
settings only) and, when it declared a budget, at its filter's order by the filter's RDP budget
(Feldman & Zrnic, NeurIPS 2021, Thm 3.1). Both bounds hold for the same run, so its RDP curve is
bounded by their pointwise minimum, and, since Rényi divergence does not decrease with the
order (van Erven & Harremoës 2014, Thm 3), by any bound at a higher order: a curve fixed
before the run. Runs bounded by such curves
compose by adding them at every order (Mironov 2017, Prop. 1, which allows each run to be
chosen after the earlier ones' outputs as long as its curve is fixed in advance); the sum is
converted at its best order (Balle et al. 2020, Thm 21). One unbounded run (NZC as published)
makes the whole unbounded. Where every run's planned work is Gaussian releases alone, their
privacy-loss distributions compose too (each fixed before its run, so adaptive composition holds:
Zhu, Dong & Wang 2022), and the smaller ε of the two is given.

A run's bound travels with what it publishes (``as_record``: plain lists, e.g. inside the student
checkpoint a later round embeds with), so a later round states the composition by itself.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from typing import Any

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter, order_index
from conclave.privacy.accounting.guarantee import Guarantee, worst_case_guarantee
from conclave.privacy.accounting.pld import GaussianSteps, pld_epsilon
from conclave.privacy.accounting.rdp import sum_charges

THEOREM = ("runs composed: each run's RDP curve bounded by its planned worst case and, at and below its "
           "filter's order, by its budget (Feldman & Zrnic 2021, Thm 3.1; Rényi divergence grows with the order); "
           "curves added at every order (Mironov 2017, Prop. 1) and converted at the best order "
           "(Balle et al. 2020, Thm 21)")
PLD_THEOREM = ("runs composed: each run's planned Gaussian releases, fixed before it ran, composed as "
               "privacy-loss distributions (Zhu, Dong & Wang 2022; dp_accounting's PLD accountant)")


@dataclass(frozen=True)
class PublishedRun:
    """A run whose results are published: its planned worst-case work and its declared budget."""

    name: str
    planned: PrivacyCharge
    budget: RenyiFilter | None = None

    def as_record(self) -> dict[str, Any]:
        """The run's bound as plain values (lists, numbers, strings), to travel with its outputs."""
        bound = self.bound()
        plan = None if self.planned.pld is None else [[s.noise_multiplier, s.count, s.sample_rate] for s in
                                                      self.planned.pld]
        return {"run": self.name, "orders": bound.orders.tolist(), "rdp": bound.rdp.tolist(),
                "extra_delta": bound.extra_delta, "unbounded": bound.unbounded, "reason": bound.reason,
                "neighbouring": bound.neighbouring.value, "gaussian_plan": plan}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> PublishedRun:
        """A run from ``as_record``'s values: its bound stands as its planned work (no budget left to apply)."""
        plan = record.get("gaussian_plan")
        charge = PrivacyCharge(np.asarray(record["orders"], dtype=float), np.asarray(record["rdp"], dtype=float),
                               float(record["extra_delta"]), bool(record["unbounded"]), str(record["reason"]),
                               str(record["run"]), neighbouring=str(record["neighbouring"]),
                               pld=None if plan is None else tuple(GaussianSteps(float(z), int(n), float(q))
                                                                   for z, n, q in plan))
        return cls(str(record["run"]), charge)

    def bound(self) -> PrivacyCharge:
        """The run's RDP curve bound: the planned worst case, lowered to the budget at its order."""
        rdp = np.array(self.planned.rdp, dtype=float)
        if self.budget is not None and not self.planned.unbounded:
            at = order_index(self.budget.order, self.planned.orders)
            rdp[at] = min(rdp[at], self.budget.rdp_budget)
        # Rényi divergence does not decrease with the order, so a bound at one order holds at every lower one.
        rdp = np.minimum.accumulate(rdp[::-1])[::-1]
        return PrivacyCharge(self.planned.orders, rdp, self.planned.extra_delta, self.planned.unbounded,
                             self.planned.reason, self.name, neighbouring=self.planned.neighbouring)


def composed_guarantee(runs: Sequence[PublishedRun], delta: float) -> Guarantee:
    """The (ε, ``delta``) guarantee of publishing all of ``runs`` (on the same private data)."""
    if not runs:
        raise InvalidValue("no runs to compose")
    total = sum_charges([dataclasses.replace(run.bound(), pld=None) for run in runs], label="published together")
    guarantee = worst_case_guarantee(total, delta)
    if guarantee.basis != "worst-case":  # unbounded: say which run makes it so
        return guarantee
    composed = Guarantee(guarantee.epsilon, delta, "composed", guarantee.neighbouring, THEOREM, guarantee.order)
    plans = [run.planned.pld for run in runs]
    if any(plan is None for plan in plans) or total.extra_delta:
        return composed
    tighter = pld_epsilon([step for plan in plans for step in plan], delta)
    return Guarantee(tighter, delta, "composed", guarantee.neighbouring, PLD_THEOREM) if tighter < composed.epsilon \
        else composed
