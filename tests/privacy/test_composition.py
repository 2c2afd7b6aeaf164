"""Publishing several runs on the same data: their bounds compose, checked against closed forms."""
from __future__ import annotations

import math

import pytest

from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.composition import PublishedRun, composed_guarantee
from conclave.privacy.accounting.filter import RenyiFilter, rdp_budget
from conclave.privacy.accounting.guarantee import worst_case_guarantee
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS


def gaussian_queries(count: int, sigma: float) -> PrivacyCharge:
    """``count`` GNMax answers: RDP count·λ/σ² each (L2 sensitivity √2; closed form)."""
    return PrivacyCharge(DEFAULT_ORDERS, count * DEFAULT_ORDERS / sigma**2, label="gnmax")


def tight_epsilon(rdp: float, order: float, delta: float) -> float:
    """(order, rdp)-RDP → ε at δ (Balle et al. 2020, Thm 21), written out."""
    return rdp + math.log((order - 1) / order) - (math.log(delta) + math.log(order)) / (order - 1)


def test_two_budgeted_runs_compose_at_the_lower_filter_order():
    first = PublishedRun("a", gaussian_queries(550, 10.0), RenyiFilter(2.0, 1e-5, 10.2))
    second = PublishedRun("b", gaussian_queries(100, 5.0), RenyiFilter(1.0, 1e-5, 18.0))
    # at order 10.2 the second run is bounded by its budget at 18 (divergences grow with the order)
    by_hand = tight_epsilon(rdp_budget(2.0, 1e-5, 10.2) + rdp_budget(1.0, 1e-5, 18.0), 10.2, 1e-5)
    composed = composed_guarantee([first, second], 1e-5)
    assert composed.basis == "composed" and composed.epsilon <= by_hand + 1e-9
    assert composed.epsilon == pytest.approx(by_hand, rel=1e-9)  # the planned curves are far above the budgets
    assert composed.epsilon < 2.0 + 1.0  # better than adding the two (ε, δ) guarantees


def test_runs_without_budgets_compose_their_worst_cases_and_one_unbounded_run_is_unbounded():
    runs = [PublishedRun("a", gaussian_queries(40, 10.0)), PublishedRun("b", gaussian_queries(60, 10.0))]
    assert composed_guarantee(runs, 1e-5).epsilon == pytest.approx(
        worst_case_guarantee(gaussian_queries(100, 10.0), 1e-5).epsilon, rel=1e-12)
    unbounded = PrivacyCharge(DEFAULT_ORDERS, DEFAULT_ORDERS * math.inf, unbounded=True, reason="NZC")
    assert composed_guarantee([*runs, PublishedRun("nzc", unbounded)], 1e-5).epsilon == math.inf


def test_one_budgeted_run_alone_is_never_worse_than_its_own_guarantee():
    run = PublishedRun("a", gaussian_queries(550, 10.0), RenyiFilter(2.0, 1e-5, 10.2))
    assert composed_guarantee([run], 1e-5).epsilon <= 2.0 + 1e-9
    cheap = PublishedRun("b", gaussian_queries(5, 10.0), RenyiFilter(2.0, 1e-5, 10.2))
    assert composed_guarantee([cheap], 1e-5).epsilon == pytest.approx(
        worst_case_guarantee(gaussian_queries(5, 10.0), 1e-5).epsilon, rel=1e-12)  # the plan is below the budget
