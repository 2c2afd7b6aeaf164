"""The sampled Skellam vote release (``privacy.accounting.sampled_skellam``), checked against the
exact Rényi divergences summed directly in mpmath, against the sampled Gaussian it tends to as the
noise grows (Mironov, Talwar & Zhang 2019, dp_accounting's transcription), and against the looser
bounds it must never exceed."""
from __future__ import annotations

import math

import mpmath as mp
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp
from conclave.privacy.accounting.sampled_skellam import sampled_skellam_vote_charge, sampled_skellam_vote_rdp
from conclave.privacy.accounting.skellam import poisson_subsampled_rdp, skellam_integer_rdp, skellam_rdp

mp.mp.dps = 30


def _exact_rdp(alphas: list[int], q: float, mu: float, window: int) -> list[float]:
    """For each α, the max over the kNN lemma's shifts (e_a − e_b, e_a) and both directions of D_α
    between P = Sk(μ)^⊗2 and M = (1 − q)P + q·P_v, summed term by term over |k| ≤ window (each
    lattice point's P and M worked out once for every α)."""
    q, mu = mp.mpf(q), mp.mpf(mu)
    pmf = {k: mp.exp(-mu) * mp.besseli(abs(k), mu) for k in range(-window - 2, window + 3)}
    worst = [mp.mpf(0)] * len(alphas)
    for shift in ((1, -1), (1, 0)):
        added, removed = [mp.mpf(0)] * len(alphas), [mp.mpf(0)] * len(alphas)
        for a in range(-window, window + 1):
            for b in range(-window, window + 1):
                p = pmf[a] * pmf[b]
                m = (1 - q) * p + q * pmf[a - shift[0]] * pmf[b - shift[1]]
                ratio = m / p
                for n, alpha in enumerate(alphas):
                    power = ratio**alpha
                    added[n] += p * power  # m^α p^(1−α)
                    removed[n] += m / power  # p^α m^(1−α)
        worst = [max(w, mp.log(x) / (alpha - 1), mp.log(y) / (alpha - 1))
                 for w, x, y, alpha in zip(worst, added, removed, alphas)]
    return [float(w) for w in worst]


@pytest.mark.parametrize("q, mu, slack", [(0.1, 3.0, None), (0.4, 3.0, None), (0.2, 12.0, 1.25), (0.5, 25.0, 1.15)])
def test_the_curve_bounds_the_exact_divergences_and_stays_close_to_them(q, mu, slack):
    """Never below the exact divergence; close to it once the noise is not tiny (the record-added
    direction uses Cor. 3.6's moments, whose discreteness term dominates at μ = 3)."""
    orders = np.array([2.0, 3.0, 5.0, 8.0])
    ours = sampled_skellam_vote_rdp(orders, q, mu)
    for alpha, value, exact in zip(orders, ours, _exact_rdp([int(a) for a in orders], q, mu, window=40)):
        assert value >= exact * (1 - 1e-9)
        if slack is not None:
            assert value <= exact * slack, (alpha, value, exact)


def test_with_much_noise_it_is_the_sampled_gaussian_at_the_same_variance():
    """Skellam(μ) tends to N(0, μ): at σ = 45 the kNN votes' 1,000 queries at q = 0.1 cost what
    dp_accounting's sampled Gaussian at z = σ/√2 costs, to half a percent (never less by more)."""
    orders = DEFAULT_ORDERS
    ours = epsilon_from_rdp(orders, 1000 * sampled_skellam_vote_rdp(orders, 0.1, 45.0**2), 1e-5)[0]
    gaussian = rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(0.1, 45 / math.sqrt(2), orders)
    theirs = epsilon_from_rdp(orders, 1000 * np.asarray(gaussian), 1e-5)[0]
    assert theirs * 0.999 <= ours <= theirs * 1.005


@pytest.mark.parametrize("q, sigma", [(0.05, 30.0), (0.3, 4.0), (0.9, 10.0)])
def test_never_above_the_general_bound_nor_the_unsampled_release(q, sigma):
    mu = sigma**2
    ours = sampled_skellam_vote_rdp(DEFAULT_ORDERS, q, mu)
    general = poisson_subsampled_rdp(DEFAULT_ORDERS, q, skellam_integer_rdp(2.0, math.sqrt(2.0), mu))
    unsampled = skellam_rdp(DEFAULT_ORDERS, 2.0, math.sqrt(2.0), mu)
    assert (ours <= general * (1 + 1e-12)).all() and (ours <= unsampled * (1 + 1e-12)).all()
    assert (ours > 0).all() and (np.diff(ours * (DEFAULT_ORDERS - 1)) >= -1e-12).all()  # (α − 1)ε grows


def test_a_charge_composes_its_queries_and_holds_for_records_added_or_removed():
    one = sampled_skellam_vote_charge(0.1, 20.0**2, label="knn")
    forty = sampled_skellam_vote_charge(0.1, 20.0**2, count=40, label="knn")
    assert forty.neighbouring == "add-remove" and np.allclose(forty.rdp, 40 * one.rdp)
    assert sampled_skellam_vote_charge(0.1, 400.0, count=0).is_free
    assert np.allclose(sampled_skellam_vote_rdp(DEFAULT_ORDERS, 1.0, 9.0), skellam_rdp(DEFAULT_ORDERS, 2, math.sqrt(2), 9))
    with pytest.raises(ValueError, match="sample_rate"):
        sampled_skellam_vote_rdp(DEFAULT_ORDERS, 1.5, 9.0)
