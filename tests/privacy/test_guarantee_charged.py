"""The published guarantee covers everything the run's ledger charged: the plan's worst case
while the charges (each at its worst case) stay within it, their RDP composition once they
go past it (a round charged, given up at its deadline and asked again), checked against
dp_accounting's RDP accountant; a declared filter holds either way."""
from __future__ import annotations

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.filter import filter_for
from conclave.privacy.accounting.guarantee import (CHARGED_THEOREM, covers, run_guarantee,
                                                   worst_case_guarantee)
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.accounting.pld import THEOREM as PLD_THEOREM
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, gaussian_charge

DELTA = 1e-5
Z = 4.0  # noise multiplier of every release


def dp_accounting_epsilon(releases: int) -> float:
    accountant = rdp_privacy_accountant.RdpAccountant(list(DEFAULT_ORDERS))
    accountant.compose(dp_event.GaussianDpEvent(Z), releases)
    return accountant.get_epsilon(DELTA)


def ledger_with(releases: int, tmp_path=None) -> PrivacyLedger:
    ledger = PrivacyLedger(":memory:" if tmp_path is None else tmp_path / "ledger.sqlite", DELTA)
    for _ in range(releases):
        ledger.charge(gaussian_charge(Z, label="round"))
    return ledger


def test_charges_within_the_plan_keep_the_plans_figure():
    planned = gaussian_charge(Z, count=10, label="planned")
    with ledger_with(7) as ledger:  # stopped early: post-processing of the planned work
        charged = ledger.worst_case_spent()
    assert covers(planned, charged)
    assert run_guarantee(planned, DELTA, charged=charged) == worst_case_guarantee(planned, DELTA)
    with ledger_with(10) as ledger:  # every planned release, summed in another order
        assert run_guarantee(planned, DELTA, charged=ledger.worst_case_spent()) == worst_case_guarantee(planned, DELTA)


def test_a_retried_release_composes_what_was_charged():
    planned = gaussian_charge(Z, count=10, label="planned")
    with ledger_with(11) as ledger:  # one round charged, given up and asked again
        charged = ledger.worst_case_spent()
    assert not covers(planned, charged)
    guarantee = run_guarantee(planned, DELTA, charged=charged)
    plan = worst_case_guarantee(planned, DELTA)
    assert guarantee.basis == "worst-case" and guarantee.theorem == CHARGED_THEOREM and guarantee.sound
    assert guarantee.epsilon > plan.epsilon
    # RDP composition of eleven Gaussian releases, not the plan's privacy-loss distribution of ten
    assert guarantee.epsilon == pytest.approx(dp_accounting_epsilon(11), rel=1e-3)
    assert plan.theorem == PLD_THEOREM  # the plan's own figure was its (tighter) PLD one


def test_each_charge_counts_at_the_worst_case_it_was_checked_against_also_after_reopening(tmp_path):
    planned = gaussian_charge(Z, count=2, label="planned")
    worst = gaussian_charge(Z, count=2, label="batch")  # a batch of two queries, every one answered
    with PrivacyLedger(tmp_path / "ledger.sqlite", DELTA) as ledger:
        for _ in range(2):  # the batch asked twice; each time one of its two queries was answered
            ledger.charge(gaussian_charge(Z, label="batch"), worst_case=worst)
        assert np.allclose(ledger.spent().rdp, gaussian_charge(Z, count=2).rdp)  # what was released
    with PrivacyLedger.open_existing(tmp_path / "ledger.sqlite") as reopened:
        charged = reopened.worst_case_spent()
        assert np.allclose(reopened.spent().rdp, gaussian_charge(Z, count=2).rdp)
    assert np.allclose(charged.rdp, gaussian_charge(Z, count=4).rdp)
    assert run_guarantee(planned, DELTA, charged=charged).epsilon == pytest.approx(dp_accounting_epsilon(4), rel=1e-3)


def test_the_composed_figure_is_never_below_the_plans():
    # past the plan at low orders only: the plan still bounds the rest
    planned = gaussian_charge(Z, count=10, label="planned")
    charged = gaussian_charge(Z, count=11, label="charged")
    charged = type(charged)(charged.orders, np.where(charged.orders < 3, charged.rdp, 0.0), label="charged")
    guarantee = run_guarantee(planned, DELTA, charged=charged)
    assert guarantee.theorem == CHARGED_THEOREM
    assert guarantee.epsilon >= worst_case_guarantee(planned, DELTA).epsilon * (1 - 1e-9) - 1e-9


def test_a_declared_filter_still_holds_whatever_was_charged():
    planned = gaussian_charge(Z, count=10, label="planned")
    budget = filter_for(planned, 1.0, DELTA)  # below the plan's worst case
    with PrivacyLedger(":memory:", DELTA, budget) as ledger:
        while ledger.can_afford(gaussian_charge(Z)):
            ledger.charge(gaussian_charge(Z))
        charged = ledger.worst_case_spent()
    guarantee = run_guarantee(planned, DELTA, budget, charged=charged)
    assert guarantee.basis == "renyi-filter" and guarantee.epsilon == 1.0


def test_plan_and_charges_must_share_the_relation():
    planned = gaussian_charge(Z, count=10, label="planned")
    other = gaussian_charge(Z, count=11, neighbouring=Neighbouring.REPLACE_ONE)
    with pytest.raises(ValueError, match="neighbouring relation"):
        run_guarantee(planned, DELTA, charged=other)
