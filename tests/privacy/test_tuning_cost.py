"""The tuning-cost bounds against values worked out by hand from their formulas."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp
from conclave.privacy.accounting.tuning_cost import (
    TruncatedNegativeBinomial,
    random_repetition_charge,
    random_repetition_rdp,
    sweep_cost,
)

ORDERS = np.array([2.0, 4.0, 8.0, 16.0, 32.0])
# A Gaussian mechanism with noise multiplier 2: RDP λ/(2·2²) = λ/8 (Mironov 2017, Prop. 7).
GAUSS_RDP = ORDERS / 8


def test_geometric_repetitions_match_hand_computation():
    # η = 1, γ = 0.1 is the geometric distribution, E[K] = 1/γ = 10. At λ = 8 the best λ̂ on
    # the grid is 4: 2·(1 − 1/4)·(4/8) + 2·ln(10)/4 = 0.75 + 1.1512925 = 1.9012925
    # (λ̂ = 2 gives 2.5526, λ̂ = 8 gives 2.3256). ε'(8) = 8/8 + 1.9012925 + ln(10)/7.
    rdp = random_repetition_rdp(ORDERS, GAUSS_RDP, TruncatedNegativeBinomial(eta=1.0, gamma=0.1))
    assert rdp[2] == pytest.approx(1.0 + 1.9012925 + 0.3289407, abs=1e-6)
    assert rdp[2] == pytest.approx(3.2302332, abs=1e-6)


def test_fractional_eta_matches_hand_computation():
    # η = 0.5, γ = 0.2: E[K] = 0.5·0.8 / (0.2·(1 − √0.2)) = 3.6180340; ln E[K] = 1.2859309.
    # Selection term at λ̂ = 4: 1.5·(3/4)·(4/8) + 1.5·ln(5)/4 = 0.5625 + 0.6035392 = 1.1660392
    # (λ̂ = 2: 1.3945785, λ̂ = 8: 1.6142696). ε'(4) = 4/8 + 1.1660392 + 1.2859309/3 = 2.0946828.
    distribution = TruncatedNegativeBinomial(eta=0.5, gamma=0.2)
    assert distribution.expected_trials() == pytest.approx(3.6180340, abs=1e-6)
    rdp = random_repetition_rdp(ORDERS, GAUSS_RDP, distribution)
    assert rdp[1] == pytest.approx(2.0946828, abs=1e-6)


@pytest.mark.parametrize("eta,gamma", [(1.0, 0.3), (0.0, 0.1), (0.5, 0.2), (-0.5, 0.05), (2.0, 0.25)])
def test_pmf_sums_to_one_and_has_the_stated_mean(eta, gamma):
    distribution = TruncatedNegativeBinomial(eta, gamma)
    ks = np.arange(1, 800)  # (1 − γ)^800 < 1e-17 for the γ ≥ 0.05 used here
    pmf = np.array([distribution.pmf(int(k)) for k in ks])
    assert pmf.sum() == pytest.approx(1.0, abs=1e-9)
    assert float((ks * pmf).sum()) == pytest.approx(distribution.expected_trials(), rel=1e-9)


def test_pmf_special_cases_have_their_closed_forms():
    geometric = TruncatedNegativeBinomial(1.0, 0.3)  # γ(1 − γ)^(k−1)
    assert [geometric.pmf(k) for k in (1, 2, 5)] == pytest.approx([0.3, 0.3 * 0.7, 0.3 * 0.7**4])
    logarithmic = TruncatedNegativeBinomial(0.0, 0.1)  # (1 − γ)^k / (k ln(1/γ))
    assert [logarithmic.pmf(k) for k in (1, 3)] == pytest.approx(
        [0.9 / math.log(10), 0.9**3 / (3 * math.log(10))]
    )
    assert logarithmic.expected_trials() == pytest.approx(9 / math.log(10))


def test_samples_follow_the_distribution():
    distribution = TruncatedNegativeBinomial(1.0, 0.2)  # geometric, mean 5, variance 20
    rng = np.random.default_rng(0)
    draws = np.array([distribution.sample(rng) for _ in range(20000)])
    assert draws.min() >= 1
    assert draws.mean() == pytest.approx(5.0, abs=4 * math.sqrt(20 / 20000))
    assert np.mean(draws == 1) == pytest.approx(0.2, abs=0.01)


def test_invalid_parameters_are_refused():
    with pytest.raises(ValueError, match="eta"):
        TruncatedNegativeBinomial(-1.0, 0.5)
    with pytest.raises(ValueError, match="gamma"):
        TruncatedNegativeBinomial(1.0, 1.0)


def _charge(rdp, extra_delta=0.0):
    return PrivacyCharge(orders=ORDERS, rdp=np.asarray(rdp, dtype=float), extra_delta=extra_delta)


def test_composition_adds_curves_and_converts_at_the_remaining_delta():
    orders = DEFAULT_ORDERS
    z = 3.0
    trial = PrivacyCharge(orders=orders, rdp=orders / (2 * z**2), extra_delta=2e-6)  # Gaussian, plus 2e-6 spent aside
    cost = sweep_cost("composition", 1e-5, [trial] * 4)
    # Four Gaussian releases with noise multiplier 3 are one with 3/√4 = 1.5: RDP λ/(2·1.5²).
    # Their 4·2e-6 = 8e-6 δ spent aside leaves 2e-6 for converting the curve.
    expected, order = epsilon_from_rdp(orders, orders / (2 * 1.5**2), 1e-5 - 8e-6)
    assert cost.epsilon == pytest.approx(expected, rel=1e-12)
    assert cost.order == order and cost.trials == 4 and not cost.free
    assert "Mironov 2017" in cost.statement


def test_composition_with_an_unbounded_trial_is_unbounded():
    orders = DEFAULT_ORDERS
    finite = PrivacyCharge(orders=orders, rdp=orders / 8)
    unbounded = PrivacyCharge(orders=orders, rdp=np.full(orders.shape, np.inf), unbounded=True, reason="nzc")
    assert sweep_cost("composition", 1e-5, [finite, unbounded]).epsilon == math.inf


def test_a_free_sweep_costs_its_one_release_whatever_the_number_of_trials():
    orders = DEFAULT_ORDERS
    release = PrivacyCharge(orders=orders, rdp=orders / (2 * 2.0**2))
    zero = PrivacyCharge(orders=orders, rdp=np.zeros(orders.shape))
    cost = sweep_cost("free", 1e-5, [zero] * 50, release_charge=release)
    assert cost.free and cost.trials == 50
    assert cost.epsilon == pytest.approx(epsilon_from_rdp(orders, orders / 8, 1e-5)[0], rel=1e-12)
    with pytest.raises(ValueError, match="one release"):
        sweep_cost("free", 1e-5, [zero])


def test_random_repetition_cost_is_theorem_2_converted_and_beats_composing_the_expected_trials():
    orders = DEFAULT_ORDERS
    trial = PrivacyCharge(orders=orders, rdp=orders / (2 * 4.0**2))
    distribution = TruncatedNegativeBinomial(eta=1.0, gamma=0.1)  # E[K] = 10
    cost = sweep_cost("random-repetition", 1e-5, [trial] * 7, distribution=distribution)
    expected, _ = epsilon_from_rdp(orders, random_repetition_rdp(orders, trial.rdp, distribution), 1e-5)
    assert cost.epsilon == pytest.approx(expected, rel=1e-12)
    composed = sweep_cost("composition", 1e-5, [trial] * 10)
    assert cost.epsilon < composed.epsilon
    with pytest.raises(ValueError, match="method"):
        sweep_cost("best-guess", 1e-5, [trial])


def test_random_repetition_refuses_trials_that_are_not_one_algorithm():
    distribution = TruncatedNegativeBinomial(1.0, 0.1)
    with pytest.raises(ValueError, match="same algorithm"):
        random_repetition_charge([_charge(GAUSS_RDP), _charge(2 * GAUSS_RDP)], distribution)
    with pytest.raises(ValueError, match="pure RDP"):
        random_repetition_charge([_charge(GAUSS_RDP, 1e-6)], distribution)
    charge = random_repetition_charge([_charge(GAUSS_RDP)] * 3, distribution)
    np.testing.assert_allclose(charge.rdp, random_repetition_rdp(ORDERS, GAUSS_RDP, distribution))


def test_random_repetition_beats_composition_of_many_trials():
    # With E[K] = 10 the selection bound at λ = 8 (3.23) is far below composing 10 trials (10).
    distribution = TruncatedNegativeBinomial(1.0, 0.1)
    selected = random_repetition_rdp(ORDERS, GAUSS_RDP, distribution)
    assert selected[2] < 10 * GAUSS_RDP[2] / 3
