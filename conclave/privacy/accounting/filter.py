"""A privacy budget declared in advance and enforced at one fixed Rényi order.

Which releases a run makes depends on earlier outputs, and Feldman & Zrnic (NeurIPS 2021,
Thm 3.1) cover that only for a filter at one order fixed in advance: ``choose_order`` picks it
from the planned workload before any data is touched. ``reserved_delta`` caps δ spent outside
the curves. docs/privacy.md, "The ledger is the run's Rényi filter".
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS

THEOREM = ("Rényi filter at a fixed order (Feldman & Zrnic, NeurIPS 2021, Thm 3.1), converted to (ε, δ) "
           "by Balle et al. 2020, Thm 21")


def rdp_budget(epsilon: float, delta: float, order: float) -> float:
    """B such that (``order``, B)-RDP converts to exactly (``epsilon``, ``delta``)-DP (Balle et al. 2020, Thm 21)."""
    lam = float(order)
    return epsilon - math.log((lam - 1) / lam) + (math.log(delta) + math.log(lam)) / (lam - 1)


@dataclass(frozen=True)
class RenyiFilter:
    """(``epsilon``, ``delta``) declared in advance, enforced as RDP ≤ ``rdp_budget`` at ``order``."""

    epsilon: float
    delta: float
    order: float
    reserved_delta: float = 0.0  # δ for releases that spend δ outside their RDP curve

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise InvalidValue(f"a budget needs a finite epsilon > 0, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise InvalidValue(f"delta must be in (0, 1), got {self.delta}")
        if not 0 <= self.reserved_delta < self.delta:
            raise InvalidValue(f"reserved_delta must be in [0, delta), got {self.reserved_delta}")
        if not (self.order > 1 and math.isfinite(self.order)):
            raise InvalidValue(f"the filter's order must be a finite number > 1, got {self.order}")
        if not self.rdp_budget > 0:
            raise InvalidValue(
                f"epsilon={self.epsilon:g} at delta={self.delta:g} leaves no RDP budget at order {self.order:g}"
            )

    @property
    def curve_delta(self) -> float:
        """The δ the RDP curve is converted at: δ − reserved_delta."""
        return self.delta - self.reserved_delta

    @property
    def rdp_budget(self) -> float:
        return rdp_budget(self.epsilon, self.curve_delta, self.order)

    def admits(self, rdp_at_order: float, extra_delta: float) -> bool:
        """Whether spent-plus-new (RDP at ``order``, δ outside the curve) stays within the budget."""
        # A relative slack of 1e-12 absorbs the rounding of a sum that lands exactly on B.
        return rdp_at_order <= self.rdp_budget * (1 + 1e-12) and extra_delta <= self.reserved_delta * (1 + 1e-12)

    def refusal(self, spent_rdp: float, spent_extra_delta: float, charge: PrivacyCharge) -> str | None:
        """Why the filter refuses ``charge`` after ``spent_rdp`` (the RDP spent so far at its order)
        and ``spent_extra_delta`` (the δ spent outside RDP curves), in one line; None when it
        admits it. A charge with no finite bound is never admitted."""
        if charge.unbounded:
            return (f"charge {charge.label!r} has no finite privacy guarantee ({charge.reason}); "
                    f"refused by a ledger with a budget of epsilon={self.epsilon:g}")
        rdp = float(spent_rdp + charge.rdp[order_index(self.order, charge.orders)])
        extra = spent_extra_delta + charge.extra_delta
        if self.admits(rdp, extra):
            return None
        if extra > self.reserved_delta:
            return (f"charge {charge.label!r} would spend delta {extra:.3g} outside the RDP curve, over the "
                    f"{self.reserved_delta:.3g} reserved for it")
        return (f"charge {charge.label!r} would bring RDP at order {self.order:g} to {rdp:.4g}, over the budget "
                f"{self.rdp_budget:.4g} (epsilon={self.epsilon:g} at delta={self.delta:g}); spent so far "
                f"{float(spent_rdp):.4g}")

    def as_dict(self) -> dict:
        return {**asdict(self), "rdp_budget": self.rdp_budget, "theorem": THEOREM}


def order_index(order: float, orders: np.ndarray = DEFAULT_ORDERS) -> int:
    """Position of ``order`` on the grid ``orders`` (the filter's order must be a grid order)."""
    matches = np.flatnonzero(np.asarray(orders) == order)
    if matches.size != 1:
        raise InvalidValue(f"the filter's order {order:g} is not on the ledger's grid of orders")
    return int(matches[0])


def choose_order(planned: PrivacyCharge, epsilon: float, delta: float) -> float:
    """The grid order where the budget (ε, δ) admits the largest multiple of ``planned``.

    ``planned`` is the worst-case workload the run intends (public settings only: e.g. the
    mechanism's charge with every planned query answered, or a DP-SGD schedule). Its
    ``extra_delta`` is reserved out of δ.
    """
    if planned.unbounded:
        raise InvalidValue(f"no budget can hold an unbounded workload ({planned.reason})")
    curve_delta = delta - planned.extra_delta
    if not curve_delta > 0:
        raise InvalidValue(f"the planned workload's δ outside its RDP curve ({planned.extra_delta:g}) "
                         f"leaves nothing of delta={delta:g}")
    orders, rdp = planned.orders, planned.rdp
    if not np.any(rdp > 0):
        raise InvalidValue("the planned workload costs nothing: plan at least one release")
    budgets = np.array([rdp_budget(epsilon, curve_delta, lam) for lam in orders])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(rdp > 0, budgets / rdp, np.inf)
    ratio = np.where(np.isfinite(rdp) & (budgets > 0), ratio, -np.inf)
    best = int(np.argmax(ratio))
    if not ratio[best] > 0:
        raise InvalidValue(f"epsilon={epsilon:g} at delta={delta:g} leaves no RDP budget at any order")
    return float(orders[best])


def filter_for(planned: PrivacyCharge, epsilon: float, delta: float) -> RenyiFilter:
    """The filter a run declares before touching data: budget (ε, δ) at ``choose_order(planned)``."""
    return RenyiFilter(epsilon, delta, choose_order(planned, epsilon, delta), reserved_delta=planned.extra_delta)
