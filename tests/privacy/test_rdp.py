"""RDP curves and conversions against closed forms and against Opacus's accountant."""
from __future__ import annotations

import math

import numpy as np
import pytest
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp

from conclave.privacy.accounting import rdp
from conclave.privacy.accounting.rdp import (
    DEFAULT_ORDERS,
    approximate_dp_charge,
    epsilon_from_rdp,
    gaussian_charge,
    gaussian_rdp,
    pure_dp_rdp,
    pure_epsilon_charge,
    sampled_gaussian_charge,
    sampled_gaussian_rdp,
    sum_charges,
    unbounded_charge,
)
from conclave.privacy.mechanisms.gnmax import gnmax_charge

DELTA = 1e-5
OPACUS_ALPHAS = np.array(RDPAccountant.DEFAULT_ALPHAS, dtype=float)


def test_default_orders_cover_opacus_and_large_orders():
    assert np.all(np.diff(DEFAULT_ORDERS) > 0)
    assert np.array_equal(DEFAULT_ORDERS[: len(OPACUS_ALPHAS)], OPACUS_ALPHAS)
    assert DEFAULT_ORDERS.max() >= 4096


@pytest.mark.parametrize("sigma, queries", [(40.0, 100), (40.0, 1000), (100.0, 300), (200.0, 8500)])
def test_gnmax_data_independent_epsilon_matches_the_analytic_optimum(sigma, queries):
    # classic conversion of T GNMax answers: min_λ Tλ/σ² + L/(λ−1), L = log(1/δ).
    # Over real λ the optimum is at λ* = 1 + sqrt(Lσ²/T) with value T/σ² + 2·sqrt(TL)/σ.
    log_inv_delta = math.log(1 / DELTA)
    best_order = 1 + math.sqrt(log_inv_delta * sigma**2 / queries)
    optimum = queries / sigma**2 + 2 * math.sqrt(queries * log_inv_delta) / sigma
    curve = gnmax_charge(sigma, queries).rdp
    epsilon, order = epsilon_from_rdp(DEFAULT_ORDERS, curve, DELTA, conversion="classic")
    assert optimum <= epsilon <= optimum * 1.003  # the grid only costs a little
    assert epsilon == pytest.approx(queries * order / sigma**2 + log_inv_delta / (order - 1))
    exact, _ = epsilon_from_rdp([best_order], [queries * best_order / sigma**2], DELTA, conversion="classic")
    assert exact == pytest.approx(optimum, rel=1e-12)


def test_tight_conversion_formula_and_it_beats_classic():
    order, value = 10.0, 0.7
    expected = value + math.log((order - 1) / order) - (math.log(DELTA) + math.log(order)) / (order - 1)
    assert epsilon_from_rdp([order], [value], DELTA)[0] == pytest.approx(expected, rel=1e-14)
    curve = gaussian_rdp(DEFAULT_ORDERS, 1.3) * 7
    tight, _ = epsilon_from_rdp(DEFAULT_ORDERS, curve, DELTA, conversion="tight")
    classic, _ = epsilon_from_rdp(DEFAULT_ORDERS, curve, DELTA, conversion="classic")
    assert tight < classic


def test_conversion_edge_cases():
    assert epsilon_from_rdp(DEFAULT_ORDERS, np.zeros(DEFAULT_ORDERS.size), DELTA)[0] == 0.0
    eps, order = epsilon_from_rdp(DEFAULT_ORDERS, np.full(DEFAULT_ORDERS.size, np.inf), DELTA)
    assert eps == math.inf and math.isnan(order)
    # An order without a bound (NaN) is skipped, not taken as the minimum.
    assert epsilon_from_rdp([2.0, 8.0], [np.nan, 1.0], DELTA)[1] == 8.0
    with pytest.raises(ValueError, match="orders"):
        epsilon_from_rdp([1.0, 2.0], [0.0, 0.0], DELTA)
    with pytest.raises(ValueError, match="delta"):
        epsilon_from_rdp(DEFAULT_ORDERS, np.zeros(DEFAULT_ORDERS.size), 0.0)
    with pytest.raises(ValueError, match="align"):
        epsilon_from_rdp(DEFAULT_ORDERS, [1.0], DELTA)
    with pytest.raises(ValueError, match="conversion"):
        epsilon_from_rdp([2.0], [1.0], DELTA, conversion="loose")


def test_gaussian_and_pure_dp_closed_forms():
    orders = np.array([1.5, 2.0, 10.0, 100.0])
    assert np.allclose(gaussian_rdp(orders, 2.0), orders / 8)
    assert np.allclose(gnmax_charge(40.0, 3, label="g").rdp[:2], 3 * DEFAULT_ORDERS[:2] / 1600)
    # ε-DP ⇒ (λ, min(ε, λε²/2))-RDP
    assert np.allclose(pure_dp_rdp(orders, 0.1), [0.0075, 0.01, 0.05, 0.1])
    assert np.allclose(pure_epsilon_charge(0.1, count=4, orders=orders).rdp, 4 * pure_dp_rdp(orders, 0.1))


@pytest.mark.parametrize("epsilon0, count", [(0.1, 1), (0.1, 100), (0.02, 1000)])
def test_pure_epsilon_conversion(epsilon0, count):
    # T answers each ε0-DP: never worse than basic composition (plus the grid's smallest δ
    # term); when the zCDP route wins it matches ρ + 2·sqrt(ρ·L), ρ = Tε0²/2 (classic).
    curve = pure_epsilon_charge(epsilon0, count=count).rdp
    classic, _ = epsilon_from_rdp(DEFAULT_ORDERS, curve, DELTA, conversion="classic")
    rho, log_inv_delta = count * epsilon0**2 / 2, math.log(1 / DELTA)
    zcdp = rho + 2 * math.sqrt(rho * log_inv_delta)
    floor = log_inv_delta / (DEFAULT_ORDERS.max() - 1)
    assert classic <= min(count * epsilon0 + floor, zcdp * 1.01) + 1e-12
    assert classic >= min(count * epsilon0, zcdp) - 1e-12


@pytest.mark.parametrize(
    "sample_rate, noise_multiplier, steps",
    [(256 / 60000, 1.1, 14062), (0.01, 0.7, 100), (0.5, 2.0, 3), (1e-4, 5.0, 1), (0.02, 0.5, 10)],
)
def test_sampled_gaussian_equals_opacus(sample_rate, noise_multiplier, steps):
    ours = sampled_gaussian_rdp(DEFAULT_ORDERS, sample_rate, noise_multiplier, steps)
    assert np.all(np.isfinite(ours))
    # Opacus's pure-Python binomial loop is slow and overflows (NaN) past order ~1000, so
    # compare on the orders up to 1024 (the large orders use the same formula as 64…256).
    compared = DEFAULT_ORDERS <= 1024
    theirs = np.asarray(
        compute_rdp(
            q=sample_rate, noise_multiplier=noise_multiplier, steps=steps, orders=list(DEFAULT_ORDERS[compared])
        ),
        dtype=float,
    )
    np.testing.assert_allclose(ours[compared], theirs, rtol=1e-8, atol=1e-13)

    accountant = RDPAccountant()
    accountant.history = [(noise_multiplier, sample_rate, steps)]
    opacus_epsilon = accountant.get_epsilon(delta=DELTA)
    ours_on_opacus_grid, _ = epsilon_from_rdp(
        OPACUS_ALPHAS, sampled_gaussian_rdp(OPACUS_ALPHAS, sample_rate, noise_multiplier, steps), DELTA
    )
    assert ours_on_opacus_grid == pytest.approx(opacus_epsilon, rel=1e-8)
    ours_full, _ = epsilon_from_rdp(DEFAULT_ORDERS, ours, DELTA)
    assert ours_full <= opacus_epsilon * (1 + 1e-9)  # more orders can only help


def test_dpsgd_figure_from_the_stack_notes():
    # STACK.md: q = 256/60000, σ = 1.1, 60 epochs, δ = 1e-5 → Opacus RDP ε 2.60.
    charge = sampled_gaussian_charge(256 / 60000, 1.1, int(60 * 60000 / 256))
    assert epsilon_from_rdp(charge.orders, charge.rdp, DELTA)[0] == pytest.approx(2.60, abs=0.01)


def test_sampled_gaussian_limits():
    assert np.all(sampled_gaussian_rdp(DEFAULT_ORDERS, 0.0, 1.0, 100) == 0)
    assert np.allclose(sampled_gaussian_rdp(DEFAULT_ORDERS, 1.0, 2.0, 3), 3 * gaussian_rdp(DEFAULT_ORDERS, 2.0))
    tiny = sampled_gaussian_rdp(DEFAULT_ORDERS[:20], 1e-9, 1.0, 1)
    assert np.all(tiny < 1e-12)
    # subsampling never costs more than the full-batch Gaussian
    assert np.all(sampled_gaussian_rdp(DEFAULT_ORDERS, 0.3, 1.0, 1) <= gaussian_rdp(DEFAULT_ORDERS, 1.0) + 1e-12)


def test_epsilon_decreases_with_noise():
    previous_g = previous_s = math.inf
    for noise in (0.6, 0.8, 1.0, 1.5, 2.5, 5.0):
        g = epsilon_from_rdp(DEFAULT_ORDERS, gaussian_charge(noise, count=10).rdp, DELTA)[0]
        s = epsilon_from_rdp(DEFAULT_ORDERS, sampled_gaussian_rdp(DEFAULT_ORDERS, 0.01, noise, 1000), DELTA)[0]
        assert g < previous_g and s < previous_s
        previous_g, previous_s = g, s


def test_charge_builders():
    stab = approximate_dp_charge(0.05, 1e-7, label="stability", count=3)
    assert stab.extra_delta == 1e-7 and np.allclose(stab.rdp, 3 * pure_dp_rdp(DEFAULT_ORDERS, 0.05))
    nzc = unbounded_charge("no sensitivity bound", label="nzc")
    assert nzc.unbounded and np.all(np.isinf(nzc.rdp)) and nzc.reason
    with pytest.raises(ValueError, match="why"):
        unbounded_charge("")
    total = sum_charges([stab, gaussian_charge(3.0, label="g")])
    assert np.allclose(total.rdp, stab.rdp + gaussian_rdp(DEFAULT_ORDERS, 3.0))
    assert total.extra_delta == 1e-7 and not total.unbounded
    assert sum_charges([total, nzc]).unbounded
    # the same reason, composed many times (one per batch of a run), is stated once
    other = unbounded_charge("another reason")
    assert sum_charges([nzc, total, nzc, other, nzc]).reason == "no sensitivity bound; another reason"
    with pytest.raises(ValueError, match="orders"):
        sum_charges([stab, gaussian_charge(3.0, orders=[2.0, 3.0])])
    with pytest.raises(ValueError):
        rdp.gaussian_rdp(DEFAULT_ORDERS, 0.0)
