"""The Poisson-sampled Gaussian charge (Mironov, Talwar & Zhang 2019) against Google's dp_accounting,
the q = 1 closed form and a numerical integration; and releases sharing one sample."""
from __future__ import annotations

import math

import dp_accounting
import mpmath
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, gaussian_rdp, sampled_gaussian_rdp
from conclave.privacy.accounting.subsampled import (GaussianRelease, poisson_sampled_gaussian_charge,
                                                    shared_sample_noise_multiplier)

INTEGER = np.array([float(o).is_integer() for o in DEFAULT_ORDERS])
# Private-kNN's settings (q 0.05–0.1; screening σ1 = 75 at Δ = 1, argmax σ2 = 25 at Δ₂ = √2) and DP-SGD ones.
SETTINGS = [(0.05, 75.0), (0.1, 75.0), (0.05, 25 / math.sqrt(2)), (0.1, 25 / math.sqrt(2)), (0.01, 0.8),
            (0.1, 2.0), (0.5, 4.0)]


def _dp_accounting_curve(events: list[dp_accounting.DpEvent]) -> np.ndarray:
    accountant = RdpAccountant(orders=[float(o) for o in DEFAULT_ORDERS])
    for event in events:
        accountant.compose(event, 1)
    return np.asarray(accountant._rdp, dtype=float)  # dp_accounting exposes no getter for the curve


def _sampled(q: float, z: float) -> dp_accounting.DpEvent:
    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))


@pytest.mark.parametrize("q, z", SETTINGS)
def test_equals_dp_accounting_at_integer_orders(q, z):
    ours = sampled_gaussian_rdp(DEFAULT_ORDERS, q, z, 1)
    theirs = _dp_accounting_curve([_sampled(q, z)])
    np.testing.assert_allclose(ours[INTEGER], theirs[INTEGER], rtol=1e-6)
    # At fractional orders this dp_accounting release returns an upper bound, so ours is never larger
    # (ours is MTZ's series, equal to Opacus in test_rdp and to an integration below).
    assert np.all(ours[~INTEGER] <= theirs[~INTEGER] * (1 + 1e-9))


@pytest.mark.parametrize("q, z", [(0.05, 75.0), (0.1, 25 / math.sqrt(2))])
@pytest.mark.parametrize("order", [1.5, 10.5])
def test_fractional_orders_equal_the_integral(q, z, order):
    """A_λ = E_{x~N(0,z²)}[((1 − q) + q·e^{(2x − 1)/(2z²)})^λ], integrated at 40 digits (MTZ 2019, §3)."""
    with mpmath.workdps(40):
        q_, z_ = mpmath.mpf(q), mpmath.mpf(z)
        density = lambda x: mpmath.npdf(x, 0, z_) * ((1 - q_) + q_ * mpmath.exp((2 * x - 1) / (2 * z_**2))) ** order
        a = mpmath.quad(density, [-mpmath.inf, -10 * z_, 0, 10 * z_, mpmath.inf])
        exact = float(mpmath.log(a) / (order - 1))
    ours = sampled_gaussian_rdp(np.array([order]), q, z, 1)[0]
    assert ours == pytest.approx(exact, rel=1e-6)


def test_q_one_is_the_gaussian_and_the_curve_grows_with_q():
    assert np.allclose(sampled_gaussian_rdp(DEFAULT_ORDERS, 1.0, 17.5, 1), DEFAULT_ORDERS / (2 * 17.5**2),
                       rtol=1e-12)
    curves = [sampled_gaussian_rdp(DEFAULT_ORDERS, q, 25 / math.sqrt(2), 1) for q in (0.0, 0.01, 0.05, 0.1, 0.5, 1.0)]
    assert not curves[0].any()
    for smaller, larger in zip(curves, curves[1:]):
        assert np.all(smaller <= larger) and np.any(smaller < larger)


def test_one_release_per_sample_is_the_sampled_gaussian():
    charge = poisson_sampled_gaussian_charge(0.05, [GaussianRelease(25.0, math.sqrt(2))], count=1000, label="knn")
    assert charge.neighbouring == Neighbouring.ADD_REMOVE and charge.label == "knn"
    np.testing.assert_allclose(charge.rdp[INTEGER],
                               1000 * _dp_accounting_curve([_sampled(0.05, 25 / math.sqrt(2))])[INTEGER], rtol=1e-6)
    assert poisson_sampled_gaussian_charge(0.05, [GaussianRelease(1.0, 1.0)], count=0).is_free


def test_releases_on_one_sample_are_one_whitened_release_and_cost_more_than_separate_ones():
    screening, argmax = GaussianRelease(75.0, 1.0), GaussianRelease(25.0, math.sqrt(2))
    z = shared_sample_noise_multiplier([screening, argmax])
    assert z == pytest.approx((1 / 75.0**2 + 2 / 25.0**2) ** -0.5)
    joint = poisson_sampled_gaussian_charge(0.1, [screening, argmax]).rdp
    np.testing.assert_allclose(joint[INTEGER], _dp_accounting_curve([_sampled(0.1, z)])[INTEGER], rtol=1e-6)
    # Separate sampled charges would undercount a shared sample (the record is in both or neither) ...
    separate = _dp_accounting_curve([_sampled(0.1, 75.0), _sampled(0.1, 25 / math.sqrt(2))])
    assert np.all(joint[INTEGER] >= separate[INTEGER] * (1 - 1e-9))
    # ... and at q = 1 (no sampling) both are the Gaussian's λ/(2z²), equal.
    full = poisson_sampled_gaussian_charge(1.0, [screening, argmax]).rdp
    assert np.allclose(full, gaussian_rdp(DEFAULT_ORDERS, 75.0) + gaussian_rdp(DEFAULT_ORDERS, 25 / math.sqrt(2)))


@pytest.mark.parametrize("bad, message", [(lambda: GaussianRelease(0.0, 1.0), "sigma > 0"),
                                          (lambda: shared_sample_noise_multiplier([]), "no releases"),
                                          (lambda: poisson_sampled_gaussian_charge(1.5, [GaussianRelease(1.0, 1.0)]),
                                           "sample_rate"),
                                          (lambda: poisson_sampled_gaussian_charge(0.1, [GaussianRelease(1.0, 1.0)],
                                                                                   count=-1), "count")])
def test_bad_input_is_one_line(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()
