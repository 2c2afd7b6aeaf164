"""Skellam RDP (Agarwal et al. 2021, Cor. 3.6) and Poisson subsampling (Zhu & Wang 2019, Thm. 6).

Checked three ways: an independent mpmath transcription of each closed form; the exact Rényi
divergence of shifted Skellam distributions (pmf e^{−μ}·I_k(μ) summed in mpmath), which the bound
must never undercut; and dp_accounting's exact Poisson-sampled Gaussian, which the general
subsampling bound applied to a Gaussian base must never undercut.
"""
from __future__ import annotations

import functools
import math

import dp_accounting
import mpmath as mp
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from scipy import special

from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp, gaussian_rdp, sampled_gaussian_rdp
from conclave.privacy.accounting.skellam import (
    poisson_subsampled_rdp,
    skellam_charge,
    skellam_rdp,
    subsampled_skellam_charge,
    subsampled_skellam_rdp,
)

DELTA = 1e-5
INTEGER_ORDERS = np.arange(2, 65, dtype=float)
FRACTIONAL_ORDERS = np.array([1.1, 1.5, 1.9, 2.5, 3.7, 10.9, 33.3])
ORDERS = np.concatenate([FRACTIONAL_ORDERS, INTEGER_ORDERS])


# --- independent transcriptions (mpmath, 40 digits) ----------------------------------------


def _mp_skellam(alpha: int, l1, l2, mu) -> mp.mpf:
    """Agarwal, Kairouz, Liu 2021, Cor. 3.6, written out again."""
    l1, l2, mu = mp.mpf(l1), mp.mpf(l2), mp.mpf(mu)
    return alpha * l2**2 / (2 * mu) + min(((2 * alpha - 1) * l2**2 + 6 * l1) / (4 * mu**2), 3 * l1 / (2 * mu))


def _mp_zhu_wang(alpha: int, q, eps) -> mp.mpf:
    """Zhu & Wang 2019, Thm. 6, term by term, capped by the base ε(α)."""
    q = mp.mpf(q)
    total = (1 - q) ** (alpha - 1) * (1 + (alpha - 1) * q)
    total += mp.binomial(alpha, 2) * q**2 * (1 - q) ** (alpha - 2) * mp.exp(eps(2))
    for l in range(3, alpha + 1):
        total += 3 * mp.binomial(alpha, l) * q**l * (1 - q) ** (alpha - l) * mp.exp((l - 1) * eps(l))
    return min(mp.log(total) / (alpha - 1), eps(alpha))


def _mp_at_orders(orders, integer_value) -> np.ndarray:
    """Integer orders as they are; in between, (α − 1)ε(α) interpolated linearly (0 at α = 1)."""
    out = []
    for alpha in orders:
        lo, hi = math.floor(alpha), math.ceil(alpha)
        if lo == hi:
            out.append(integer_value(lo))
            continue
        t = mp.mpf(alpha) - lo
        k_lo = (lo - 1) * integer_value(lo) if lo >= 2 else mp.mpf(0)
        out.append(((1 - t) * k_lo + t * (hi - 1) * integer_value(hi)) / (mp.mpf(alpha) - 1))
    return np.array([float(v) for v in out])


# --- exact Rényi divergences of shifted Skellam distributions ------------------------------


@functools.lru_cache(maxsize=None)
def _skellam_logpmf(mu: float, reach: int) -> np.ndarray:
    """log P[Sk(μ) = k] = log I_k(μ) − μ for k = −reach … reach (Sk(μ) = Poisson(μ/2) − Poisson(μ/2))."""
    with mp.workdps(40):
        half = np.array([float(mp.log(mp.besseli(k, mu)) - mu) for k in range(reach + 1)])
    return np.concatenate([half[:0:-1], half])


def _reach(mu: float, shift: int, max_order: float) -> int:
    # The summand p(k − Δ)^α p(k)^{1−α} peaks near k = αΔ (width √μ) or earlier for small μ.
    return int(max_order * shift + 30 * math.sqrt(mu) + 60)


def _log_moments(mu: float, shift: int, orders, reach: int, mix: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """log Σ_k p1(k)^α p0(k)^{1−α} both ways, p0 = Sk(μ), p1 = (1 − mix)·Sk(μ) + mix·(Δ + Sk(μ))."""
    lp = _skellam_logpmf(mu, reach)
    k = np.arange(-reach + shift, reach + 1)
    log_p0 = lp[k + reach]
    log_shifted = lp[k - shift + reach]
    log_p1 = log_shifted if mix == 1 else np.logaddexp(math.log1p(-mix) + log_p0, math.log(mix) + log_shifted)
    forward, backward = [], []
    for alpha in orders:
        for out, (num, den) in ((forward, (log_p1, log_p0)), (backward, (log_p0, log_p1))):
            terms = alpha * num + (1 - alpha) * den
            total = special.logsumexp(terms)
            assert max(terms[0], terms[-1]) < total - 30, "the truncated sum missed mass"
            out.append(total)
    return np.array(forward), np.array(backward)


def _exact_divergence(mu: float, shift: int, orders, mix: float = 1.0) -> np.ndarray:
    """max of D_α(p1‖p0) and D_α(p0‖p1), the RDP of the neighbouring pair."""
    orders = np.asarray(orders, dtype=float)
    forward, backward = _log_moments(mu, shift, orders, _reach(mu, shift, orders.max()), mix)
    return np.maximum(forward, backward) / (orders - 1)


# --- the Skellam mechanism -----------------------------------------------------------------


@pytest.mark.parametrize("l1, l2, mu", [(1, 1, 0.5), (4, math.sqrt(6), 10.0), (300, 70.0, 2500.0),
                                        (31 * 65541.0, 65541.0 * math.sqrt(31), 5.2e9)])
def test_skellam_rdp_matches_an_mpmath_transcription(l1, l2, mu):
    ours = skellam_rdp(ORDERS, l1, l2, mu)
    with mp.workdps(40):
        theirs = _mp_at_orders(ORDERS, lambda a: _mp_skellam(a, l1, l2, mu))
    np.testing.assert_allclose(ours, theirs, rtol=1e-9)


def test_skellam_rdp_worked_value():
    # α = 3, Δ₁ = 4, Δ₂ = 2, μ = 10: 3·4/20 + min((5·4 + 24)/400, 12/20) = 0.6 + 0.11
    assert skellam_rdp([3.0], 4, 2, 10.0)[0] == pytest.approx(0.71, rel=1e-14)


@pytest.mark.parametrize("mu", [0.5, 3.0, 20.0, 150.0])
@pytest.mark.parametrize("shift", [1, 3])
def test_skellam_bound_is_never_below_the_exact_divergence(mu, shift):
    exact = _exact_divergence(mu, shift, ORDERS)
    bound = skellam_rdp(ORDERS, shift, shift, mu)
    assert np.all(exact <= bound * (1 + 1e-9)), ORDERS[exact > bound]


def test_multidimensional_skellam_bound_holds_for_a_vector_shift():
    # Coordinates are independent, so D_α adds over them: v = (1, −2, 1), ‖v‖₁ = 4, ‖v‖₂ = √6.
    # Sk(μ) is symmetric, so a shift by −2 costs what a shift by 2 does.
    mu = 4.0
    exact = 2 * _exact_divergence(mu, 1, ORDERS) + _exact_divergence(mu, 2, ORDERS)
    assert np.all(exact <= skellam_rdp(ORDERS, 4, math.sqrt(6), mu) * (1 + 1e-9))


def test_skellam_bound_approaches_the_gaussian_for_large_variance():
    orders = np.arange(2, 17, dtype=float)
    # μ is the variance: for large μ the exact divergence is the Gaussian α·Δ²/(2μ) and the bound
    # is within 1 % of it (a bound in terms of the Poisson rate would be off by 2×).
    mu = 400.0
    exact = _exact_divergence(mu, 1, orders)
    gaussian = orders / (2 * mu)
    np.testing.assert_allclose(exact, gaussian, rtol=5e-3)
    assert np.all(skellam_rdp(orders, 1, 1, mu) / exact < 1.01)
    for mu in (1e4, 1e6, 1e8):
        excess = skellam_rdp(orders, 3, 2, mu) / gaussian_rdp(orders, math.sqrt(mu) / 2) - 1
        assert np.all(excess > 0) and np.all(excess < 20 / mu)  # O(α/μ) relative excess


# --- Poisson subsampling (Zhu & Wang 2019, Thm. 6) -----------------------------------------


def _gaussian_base(sigma: float):
    return lambda alpha: alpha / (2 * sigma**2)


@pytest.mark.parametrize("q", [0.01, 0.1, 0.5])
@pytest.mark.parametrize("base_name", ["gaussian", "skellam"])
def test_zhu_wang_matches_an_mpmath_transcription(q, base_name):
    orders = np.concatenate([ORDERS, [100.0, 256.0]])
    if base_name == "gaussian":
        sigma = 1.3
        base, mp_base = _gaussian_base(sigma), lambda a: mp.mpf(a) / (2 * mp.mpf(sigma) ** 2)
    else:
        l1, l2, mu = 12.0, 5.0, 30.0
        base = lambda a: skellam_rdp(a, l1, l2, mu)  # noqa: E731 — integer orders only here
        mp_base = lambda a: _mp_skellam(a, l1, l2, mu)  # noqa: E731
    ours = poisson_subsampled_rdp(orders, q, base)
    with mp.workdps(40):
        theirs = _mp_at_orders(orders, lambda a: _mp_zhu_wang(a, q, mp_base))
    np.testing.assert_allclose(ours, theirs, rtol=1e-9)


@pytest.mark.parametrize("q", [0.01, 0.03, 0.1])
@pytest.mark.parametrize("sigma", [0.8, 1.0, 1.5, 2.0])
def test_zhu_wang_on_a_gaussian_bounds_the_exact_sampled_gaussian(q, sigma):
    integer_orders = np.concatenate([np.arange(2, 257), [512, 1024, 4096]]).astype(float)
    accountant = RdpAccountant(orders=list(integer_orders))
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), 1)
    exact = np.asarray(accountant._rdp, dtype=float)  # dp_accounting exposes no getter for the curve
    ours = poisson_subsampled_rdp(integer_orders, q, _gaussian_base(sigma))
    assert np.all(ours >= exact * (1 - 1e-9))
    # The general bound pays its factor 3 on the l ≥ 3 terms: at most 2.75× the exact curve here,
    # and exact at α = 2 (no such term).
    assert np.all(ours <= 3 * exact)
    assert ours[0] == pytest.approx(exact[0], rel=1e-9)
    # Between integer orders the interpolation still bounds the exact curve (Mironov et al. 2019
    # fractional series, equal to Opacus, tested in test_rdp).
    assert np.all(poisson_subsampled_rdp(DEFAULT_ORDERS, q, _gaussian_base(sigma))
                  >= sampled_gaussian_rdp(DEFAULT_ORDERS, q, sigma, 1) * (1 - 1e-9))
    # In ε at δ = 1e-5 for 100 … 1000 steps the general bound costs at most 55 % over the exact one.
    for steps in (100, 1000):
        general, _ = epsilon_from_rdp(DEFAULT_ORDERS, steps * poisson_subsampled_rdp(DEFAULT_ORDERS, q,
                                                                                       _gaussian_base(sigma)), DELTA)
        tight, _ = epsilon_from_rdp(DEFAULT_ORDERS, sampled_gaussian_rdp(DEFAULT_ORDERS, q, sigma, steps), DELTA)
        assert tight * (1 - 1e-12) <= general <= 1.55 * tight


def test_subsampled_skellam_bounds_the_exact_subsampled_divergence():
    # One shifted coordinate, q = 0.2: the mixture (1 − q)·Sk + q·(1 + Sk) against Sk, both ways.
    mu, q = 3.0, 0.2
    orders = np.concatenate([FRACTIONAL_ORDERS[:-1], np.arange(2, 33, dtype=float)])
    exact = _exact_divergence(mu, 1, orders, mix=q)
    ours = subsampled_skellam_rdp(orders, q, 1, 1, mu, steps=1)
    assert np.all(exact <= ours * (1 + 1e-9))
    assert np.all(ours < skellam_rdp(orders, 1, 1, mu))  # and subsampling does amplify here


def test_subsampling_limits():
    base = lambda a: skellam_rdp(a, 4, 2, 10.0)  # noqa: E731
    np.testing.assert_array_equal(poisson_subsampled_rdp(ORDERS, 1.0, base), skellam_rdp(ORDERS, 4, 2, 10.0))
    assert not np.any(poisson_subsampled_rdp(ORDERS, 0.0, base))
    assert not np.any(subsampled_skellam_rdp(ORDERS, 0.1, 4, 2, 10.0, steps=0))
    np.testing.assert_allclose(subsampled_skellam_rdp(ORDERS, 1.0, 4, 2, 10.0, steps=7),
                               7 * skellam_rdp(ORDERS, 4, 2, 10.0), rtol=1e-14)
    # never more than the unsampled mechanism, and monotone in q
    curves = [subsampled_skellam_rdp(DEFAULT_ORDERS, q, 4, 2, 10.0, steps=1) for q in (0.01, 0.1, 0.5, 1.0)]
    assert all(np.all(a <= b * (1 + 1e-12)) for a, b in zip(curves, curves[1:]))


# --- charges and the DP-SGD figures ------------------------------------------------------


def _dpsgd_epsilons(q: float, sigma: float, steps: int, dim: int = 31) -> tuple[float, float]:
    """(Skellam ε, Gaussian ε) at δ = 1e-5: scale 2^16, deterministic rounding, μ = (σ·Δ₂)²."""
    l2 = 2.0**16 + math.sqrt(dim)  # clip norm 1 scaled by 2^16, plus the rounding's √d
    l1 = math.sqrt(dim) * l2  # ‖v‖₁ ≤ √d·‖v‖₂
    charge = subsampled_skellam_charge(q, l1, l2, (sigma * l2) ** 2, steps, label="dpsgd-secure")
    assert np.all(np.isfinite(charge.rdp))  # finite on the ledger's whole grid
    skellam, _ = epsilon_from_rdp(charge.orders, charge.rdp, DELTA)
    gaussian, _ = epsilon_from_rdp(DEFAULT_ORDERS, sampled_gaussian_rdp(DEFAULT_ORDERS, q, sigma, steps), DELTA)
    return skellam, gaussian


@pytest.mark.parametrize("q, sigma, steps, expected_skellam, expected_gaussian",
                         [(0.1, 1.1, 150, 9.841, 8.014), (0.01, 1.0, 1000, 2.450, 2.101)])
def test_dpsgd_over_secure_aggregation_is_close_to_the_gaussian(q, sigma, steps, expected_skellam,
                                                                 expected_gaussian):
    skellam, gaussian = _dpsgd_epsilons(q, sigma, steps)
    assert gaussian == pytest.approx(expected_gaussian, abs=1e-3)
    assert skellam == pytest.approx(expected_skellam, abs=1e-3)
    assert gaussian < skellam < 1.25 * gaussian  # the price of the general subsampling bound


def test_charge_builders():
    charge = subsampled_skellam_charge(0.05, 40.0, 10.0, 400.0, 20, label="dpsgd")
    assert charge.neighbouring == Neighbouring.ADD_REMOVE and charge.label == "dpsgd"
    np.testing.assert_array_equal(charge.orders, DEFAULT_ORDERS)
    np.testing.assert_allclose(charge.rdp, subsampled_skellam_rdp(DEFAULT_ORDERS, 0.05, 40.0, 10.0, 400.0, 20))
    assert charge.details == {"sample_rate": 0.05, "l1_sensitivity": 40.0, "l2_sensitivity": 10.0,
                              "variance": 400.0, "steps": 20}
    full = skellam_charge(40.0, 10.0, 400.0, count=3, label="pca", orders=ORDERS)
    np.testing.assert_allclose(full.rdp, 3 * skellam_rdp(ORDERS, 40.0, 10.0, 400.0))
    assert full.neighbouring == Neighbouring.ADD_REMOVE and full.details["count"] == 3


@pytest.mark.parametrize("call, match", [
    (lambda: skellam_rdp(ORDERS, 1, 1, 0.0), "variance"),
    (lambda: skellam_rdp(ORDERS, 1, 1, math.inf), "variance"),
    (lambda: skellam_rdp(ORDERS, 1, -1, 1.0), "l2_sensitivity"),
    (lambda: skellam_rdp(ORDERS, 1, 2, 1.0), "l1_sensitivity"),  # ‖v‖₁ < ‖v‖₂ is impossible: swapped?
    (lambda: skellam_rdp([1.0, 2.0], 1, 1, 1.0), "orders"),
    (lambda: subsampled_skellam_rdp(ORDERS, 1.5, 1, 1, 1.0, 1), "sample_rate"),
    (lambda: subsampled_skellam_rdp(ORDERS, 0.1, 1, 1, 1.0, -1), "steps"),
    (lambda: subsampled_skellam_rdp(ORDERS, -0.1, 1, 1, 1.0, 0), "sample_rate"),
    (lambda: skellam_charge(1, 1, 1.0, count=-1), "count"),
])
def test_bad_input_is_refused_with_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
