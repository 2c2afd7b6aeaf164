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
makes the whole unbounded.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter, order_index
from conclave.privacy.accounting.guarantee import Guarantee, worst_case_guarantee
from conclave.privacy.accounting.rdp import sum_charges

THEOREM = ("runs composed: each run's RDP curve bounded by its planned worst case and, at and below its "
           "filter's order, by its budget (Feldman & Zrnic 2021, Thm 3.1; Rényi divergence grows with the order); "
           "curves added at every order (Mironov 2017, Prop. 1) and converted at the best order "
           "(Balle et al. 2020, Thm 21)")


@dataclass(frozen=True)
class PublishedRun:
    """A run whose results are published: its planned worst-case work and its declared budget."""

    name: str
    planned: PrivacyCharge
    budget: RenyiFilter | None = None

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
        raise ValueError("no runs to compose")
    total = sum_charges([run.bound() for run in runs], label="published together")
    guarantee = worst_case_guarantee(total, delta)
    if guarantee.basis != "worst-case":  # unbounded: say which run makes it so
        return guarantee
    return Guarantee(guarantee.epsilon, delta, "composed", guarantee.neighbouring, THEOREM, guarantee.order)
