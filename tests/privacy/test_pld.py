"""The tighter (ε, δ) of work fixed in advance (``privacy.accounting.pld``): the closed form of the
Gaussian against dp_accounting's PLD, the PLD never above the RDP figure for the same plan, and the
worst-case guarantee taking the smaller, with its theorem."""
from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant

from conclave.privacy.accounting import pld
from conclave.privacy.accounting.guarantee import WORST_CASE_THEOREM, worst_case_guarantee
from conclave.privacy.accounting.rdp import epsilon_from_rdp, gaussian_charge, sampled_gaussian_charge, sum_charges
from conclave.privacy.accounting.skellam import skellam_charge
from conclave.privacy.mechanisms import build_mechanism

DELTA = 1e-5


def _dp_accounting(*events) -> float:
    accountant = pld_privacy_accountant.PLDAccountant()
    for event, count in events:
        accountant.compose(event, count)
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("z", [0.8, 3.0, 23.1, 80.0])
def test_one_gaussian_in_closed_form_matches_dp_accounting(z):
    ours = pld.analytic_gaussian_epsilon(z, DELTA)
    assert ours == pytest.approx(_dp_accounting((dp_accounting.GaussianDpEvent(z), 1)), rel=1e-6, abs=1e-6)


def test_gaussians_on_the_whole_data_compose_into_one():
    plan = [pld.GaussianSteps(14.0, 300), pld.GaussianSteps(28.0, 100)]
    z = 1 / math.sqrt(300 / 14.0**2 + 100 / 28.0**2)
    assert pld.pld_epsilon(plan, DELTA) == pytest.approx(pld.analytic_gaussian_epsilon(z, DELTA), rel=1e-12)
    assert pld.pld_epsilon(plan, DELTA) == pytest.approx(
        _dp_accounting((dp_accounting.GaussianDpEvent(14.0), 300), (dp_accounting.GaussianDpEvent(28.0), 100)), rel=1e-6)


@pytest.mark.parametrize("charge", [
    build_mechanism("gnmax", sigma=40.0).run_charge(300, 300),
    build_mechanism("public-clusters", sigma=40.0, m=3).worst_case_charge(300),
    build_mechanism("private-knn", sigma1=45.0, threshold=210.0, sigma2=45.0, sample_rate=0.1).run_charge(1000, 1000),
    sampled_gaussian_charge(256 / 60000, 1.1, 2000),
], ids=["gnmax", "public-clusters", "private-knn", "dp-sgd"])
def test_the_pld_figure_is_never_above_the_rdp_one_and_is_what_is_published(charge):
    rdp, _ = epsilon_from_rdp(charge.orders, charge.rdp, DELTA)
    guarantee = worst_case_guarantee(charge, DELTA)
    assert guarantee.epsilon == pld.pld_epsilon(charge.pld, DELTA) <= rdp
    assert guarantee.theorem == pld.THEOREM and guarantee.basis == "worst-case"


def test_a_plan_with_other_than_gaussian_releases_keeps_its_rdp_figure():
    mixed = sum_charges([gaussian_charge(5.0, count=10), skellam_charge(2.0, math.sqrt(2), 25.0, count=10)])
    assert mixed.pld is None
    assert worst_case_guarantee(mixed, DELTA).theorem == WORST_CASE_THEOREM
    twice = gaussian_charge(5.0, count=10).scaled(2)
    assert twice.pld == (pld.GaussianSteps(5.0, 20),) and gaussian_charge(5.0).scaled(0).is_free


def test_a_schedules_checkpoints_compose_bit_for_bit_as_dp_accounting_does():
    """``_composed`` builds each release's PLD once and self-composes it per count: every figure
    is the accountant's own, to the bit, for checkpoints of one schedule (a cached release) and for
    plans that mix whole-data and sampled steps."""
    def accountant(steps) -> float:
        events = []
        for step in steps:
            event = dp_accounting.GaussianDpEvent(step.noise_multiplier)
            events.append((event if step.sample_rate == 1 else dp_accounting.PoissonSampledDpEvent(step.sample_rate,
                                                                                                    event), step.count))
        return _dp_accounting(*events)

    checkpoints = [(pld.GaussianSteps(2.0, 20 * epoch, 0.05),) for epoch in (1, 2, 3)]
    mixed = [(pld.GaussianSteps(20.0, 1), pld.GaussianSteps(2.0, 40, 0.05)),
             (pld.GaussianSteps(3.0, 40, 0.1), pld.GaussianSteps(2.0, 60, 0.05), pld.GaussianSteps(3.0, 10, 0.1))]
    for steps in checkpoints + mixed:
        assert pld._composed(steps, DELTA) == accountant(steps), steps
