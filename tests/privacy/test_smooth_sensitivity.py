"""Smooth-sensitivity release of the data-dependent cost (PATE 2018 App. C, Theorem 23).

Checked three ways: against the published reference analysis' test values (tensorflow/privacy
research/pate_2018 smooth_sensitivity_test), against brute force over every histogram of a
small ensemble, and against the closed forms of the release.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from privacy.accounting import pate
from privacy.accounting import smooth_sensitivity as ss
from privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp, gaussian_charge
from privacy.accounting.report import analysis_report
from privacy.mechanisms import build_mechanism
from privacy.noise import NoisePolicy

# --- values from the PATE 2018 reference analysis' tests --------------------------------------


def test_gnmax_local_sensitivity_by_distance_matches_reference_going_right():
    out = ss.gnmax_local_sensitivity_by_distance(np.array([[10, 0, 0]]), 10, 0.5, 1.5)[0]
    expected = [3.13503646e-17, 1.60178280e-08, 5.90681786e-03] + [5.99981308e00] * 7
    assert out == pytest.approx(expected, rel=1e-8)


def test_gnmax_local_sensitivity_by_distance_matches_reference_going_left():
    out = ss.gnmax_local_sensitivity_by_distance(np.array([[1000, 500, 300, 200, 0]]), 2000, 250.0, 10.0)[0]
    expected = [0.0] * 298 + [2.77693450548e-7, 2.10853979548e-6] + [2.73113623988e-6] * 1700
    assert out == pytest.approx(expected, rel=1e-8, abs=1e-20)


@pytest.mark.parametrize(
    "threshold,expected",
    [
        (16, [0] * 3 + [1.48454129e-04, 1.47826870e-02, 3.94153241e-02, 6.45775697e-02, 9.01543247e-02,
                        1.16054002e-01, 1.42180452e-01, 1.42180452e-01, 1.48454129e-04, 1.47826870e-02,
                        3.94153241e-02, 6.45775697e-02, 9.01543266e-02, 1.16054000e-01, 1.42180452e-01,
                        1.68302106e-01, 1.93127860e-01]),
        (2, [1.60212079e-01, 2.07021132e-01, 2.07021132e-01, 1.93127860e-01, 1.68302106e-01, 1.42180452e-01,
             1.16054002e-01, 9.01543247e-02, 6.45775697e-02, 3.94153241e-02, 1.47826870e-02, 1.48454129e-04]
         + [0] * 8),
        (50, [1.35750725752e-19, 1.88990500499e-17, 2.05403154065e-15, 1.74298153642e-13, 1.15489723995e-11,
              5.97584949325e-10, 2.41486826748e-08, 7.62150641922e-07, 1.87846248741e-05, 0.000360973025976,
              0.000360973025976, 2.76377015215e-50, 1.00904975276e-53, 2.87254164748e-57, 6.37583360761e-61,
              1.10331620211e-64, 1.48844393335e-68, 1.56535552444e-72, 1.28328011060e-76, 8.20047697109e-81]),
    ],
)
def test_threshold_local_sensitivity_matches_reference(threshold, expected):
    out = ss.threshold_local_sensitivity_by_distance(np.array([[20, 10, 0]]), 30, threshold, 2.0, 10.0)[0]
    # distances 0..19 as in the reference; at d = 20 the maximum can reach 0, which the
    # reference leaves out and we keep (a larger, still valid bound)
    assert out[:20] == pytest.approx(expected, rel=1e-6, abs=1e-300)
    assert np.all(out[21:] == 0)


def test_conditions_c5_c6_match_reference():
    assert ss.check_conditions(20.0, 10, 25.0) == (True, False)
    assert ss.check_conditions(30.0, 10, 25.0) == (True, True)


# --- brute force on a small ensemble ---------------------------------------------------------


def all_histograms(teachers: int, classes: int) -> np.ndarray:
    rows = []
    for cut in itertools.combinations(range(teachers + classes - 1), classes - 1):
        bounds = (-1, *cut, teachers + classes - 1)
        rows.append([bounds[i + 1] - bounds[i] - 1 for i in range(classes)])
    return np.array(rows)


def brute_force_ls_within(teachers, classes, sigma, order):
    """max LS over all histograms within distance d of each histogram, from every neighbour pair."""
    hists = all_histograms(teachers, classes)
    index = {tuple(h): i for i, h in enumerate(hists)}
    beta = ss.gnmax_beta(pate.gnmax_logq(hists, sigma), sigma, order)
    local = np.zeros(len(hists))
    for i, h in enumerate(hists):
        for a, b in itertools.permutations(range(classes), 2):
            if h[a] > 0:
                g = h.copy()
                g[a] -= 1
                g[b] += 1
                local[i] = max(local[i], abs(beta[index[tuple(g)]] - beta[i]))
    distance = np.abs(hists[:, None, :] - hists[None, :, :]).sum(axis=2) // 2
    within = np.array([[local[distance[i] <= d].max() for d in range(teachers)] for i in range(len(hists))])
    return hists, within


@pytest.mark.parametrize("teachers,sigma,order", [(12, 1.0, 2.0), (30, 3.0, 3.0)])
def test_local_sensitivity_bounds_every_neighbour_when_conditions_hold(teachers, sigma, order):
    assert ss.check_conditions(sigma, 3, order) == (True, True)
    hists, within = brute_force_ls_within(teachers, 3, sigma, order)
    ours = np.maximum.accumulate(ss.gnmax_local_sensitivity_by_distance(hists, teachers, sigma, order), axis=1)
    assert np.all(ours >= within - 1e-12)
    assert within.max() > 0.1  # the check is not vacuous


def test_conditions_failing_is_exactly_when_algorithm3_can_be_wrong():
    # σ = 3, λ = 8: C6 fails, and brute force finds a neighbour pair beyond Algorithm 3's bound;
    # that is why the release refuses to run when C5/C6 do not hold.
    assert ss.check_conditions(3.0, 3, 8.0) == (True, False)
    hists, within = brute_force_ls_within(30, 3, 3.0, 8.0)
    ours = np.maximum.accumulate(ss.gnmax_local_sensitivity_by_distance(hists, 30, 3.0, 8.0), axis=1)
    assert np.any(ours < within - 1e-6)


def test_released_function_equals_the_reported_bound_at_pate_settings():
    for sigma, order in ((40.0, 15.0), (40.0, 100.0), (math.sqrt(2) * 150.0, 15.0)):
        logq = np.linspace(30 * ss.gnmax_logq0(sigma, order), -1e-3, 5000)
        assert ss.gnmax_beta(logq, sigma, order) == pytest.approx(pate.gnmax_rdp(logq, sigma, [order])[:, 0], rel=1e-9)


def test_threshold_local_sensitivity_by_enumeration():
    # the threshold cost depends only on m = max n_j; LS^(d) is the largest one-step change
    # of the cost over every m' within d of m
    teachers, threshold, sigma1, order = 40, 25.0, 4.0, 6.0
    maxima = np.arange(teachers + 1)
    logq = pate.threshold_logq(np.stack([maxima, np.zeros_like(maxima)], axis=1), threshold, sigma1)
    cost = pate.threshold_rdp(logq, sigma1, [order])[:, 0]
    step = np.abs(np.diff(cost))
    for m in (20, 25, 33, 40):  # [m, 40 − m] has maximum m
        ls = ss.threshold_local_sensitivity_by_distance(np.array([[m, teachers - m]]), teachers, threshold, sigma1, order)[0]
        for d in range(teachers):
            reachable = [s for v, s in enumerate(step) if abs(v - m) <= d or abs(v + 1 - m) <= d]
            assert max(ls[: d + 1]) == pytest.approx(max(reachable), rel=1e-12)


# --- the release ---------------------------------------------------------------------------


def test_smooth_sensitivity_is_the_discounted_maximum():
    ls = np.array([0.1, 0.5, 2.0, 0.0])
    beta = 0.4
    assert ss.smooth_sensitivity(ls, beta) == pytest.approx(max(0.1, 0.5 * math.exp(-0.4), 2.0 * math.exp(-0.8)))


def test_gnss_rdp_is_theorem_23():
    beta, sigma_ss, order = 0.02, 5.0, 15.0
    expected = order * math.exp(0.04) / 25.0 + (0.3 - 0.5 * math.log(1 - 0.6)) / 14.0
    assert ss.gnss_rdp(beta, sigma_ss, order) == pytest.approx(expected, rel=1e-14)
    with pytest.raises(ValueError, match="order"):
        ss.gnss_rdp(0.05, 5.0, 15.0)  # λ must stay below 1/(2β) = 10


def test_default_parameters_come_from_the_planned_workload_alone():
    planned = gaussian_charge(40.0 / math.sqrt(2), count=640)  # 640 GNMax answers at σ = 40
    params = ss.SmoothSensitivityParameters.for_workload(planned, 1e-5)
    _, worst_order = epsilon_from_rdp(planned.orders, planned.rdp, 1e-5)
    assert params.order == pytest.approx(1 + 2 * (worst_order - 1))
    assert params.beta == pytest.approx(0.4 / params.order)
    # σ_ss puts the release's main cost term at 5% of the worst case at that order
    worst_at_order = 640 * params.order / 40.0**2
    assert params.order * math.exp(2 * params.beta) / params.sigma_ss**2 == pytest.approx(0.05 * worst_at_order)
    with pytest.raises(ValueError, match="order < 1/\\(2 beta\\)"):
        ss.SmoothSensitivityParameters(order=20.0, beta=0.03, sigma_ss=5.0)


def test_the_release_is_charged_like_any_release():
    params = ss.SmoothSensitivityParameters(order=20.0, beta=0.02, sigma_ss=5.0)
    charge = params.charge(DEFAULT_ORDERS)
    valid = DEFAULT_ORDERS < 25.0  # Theorem 23 holds below 1/(2β)
    assert np.isinf(charge.rdp[~valid]).all()
    assert charge.rdp[valid] == pytest.approx([ss.gnss_rdp(0.02, 5.0, lam) for lam in DEFAULT_ORDERS[valid]])
    assert charge.neighbouring == "one-vote"


def test_release_adds_gaussian_noise_scaled_to_smooth_sensitivity():
    ls = np.linspace(0.05, 0.01, 100)
    params = ss.SmoothSensitivityParameters(order=15.0, beta=0.02, sigma_ss=6.0)
    policy = NoisePolicy(insecure_seed=7)
    estimate = ss.release_estimate(ss.SmoothTerms(1.5, ls), params, 1e-5, "tight", policy.source("s"))
    z = policy.source("s").rng.normal(0.0, 1.0)
    smooth = ss.smooth_sensitivity(ls, 0.02)
    assert estimate.details["released_rdp"] == pytest.approx(1.5 + smooth * 6.0 * z)
    assert estimate.details["release_rdp_cost"] == pytest.approx(ss.gnss_rdp(0.02, 6.0, 15.0))
    assert "smooth_sensitivity" not in estimate.details and "noise_std" not in estimate.details
    flat = ss.release_estimate(ss.SmoothTerms(1.5, np.zeros(100)), params, 1e-5, "tight", policy.source("s"))
    assert flat.details["released_rdp"] == 1.5  # a cost equal on every histogram reveals nothing


def test_report_release_with_fixed_public_parameters():
    votes = np.array([[240, 5, 5], [200, 40, 10], [250, 0, 0], [180, 60, 10]] * 20)
    mech = build_mechanism("gnmax", sigma=40.0)
    params = ss.SmoothSensitivityParameters(order=20.0, beta=0.02, sigma_ss=5.0)
    report = analysis_report(mech, votes, None, 1e-5, smooth=params, noise=NoisePolicy(insecure_seed=5))
    release = report.estimate("smooth-sensitivity")
    assert release.details["available"] and not release.private
    assert (release.details["order"], release.details["beta"], release.details["sigma_ss"]) == (20.0, 0.02, 5.0)
    ls = ss.gnmax_local_sensitivity_by_distance(votes, 250, 40.0, 20.0).sum(axis=0)
    exact = pate.gnmax_rdp(pate.gnmax_logq(votes, 40.0), 40.0, [20.0]).sum()
    z = NoisePolicy(insecure_seed=5).source("smooth-sensitivity").rng.normal()
    assert release.details["released_rdp"] == pytest.approx(exact + ss.smooth_sensitivity(ls, 0.02) * 5.0 * z)
    expected, _ = epsilon_from_rdp([20.0], [release.details["released_rdp"] + ss.gnss_rdp(0.02, 5.0, 20.0)], 1e-5)
    assert release.epsilon == pytest.approx(expected)
    # the guarantee pays for the release: the worst case of 80 answers plus its own cost
    planned = 80 * DEFAULT_ORDERS / 40.0**2 + params.charge(DEFAULT_ORDERS).rdp
    assert report.guarantee.epsilon == pytest.approx(epsilon_from_rdp(DEFAULT_ORDERS, planned, 1e-5)[0])


def test_release_is_refused_when_conditions_fail():
    # σ = 3, k = 3, λ = 8 violates C6 (see above): no data-dependent figure may be published
    votes = np.array([[30, 0, 0], [20, 8, 2]])
    params = ss.SmoothSensitivityParameters(order=8.0, beta=0.05, sigma_ss=5.0)
    report = analysis_report(build_mechanism("gnmax", sigma=3.0), votes, None, 1e-5, smooth=params)
    release = report.estimate("smooth-sensitivity")
    assert release.details["available"] is False and "C5/C6" in release.details["reason"]
    assert release.epsilon is None


def test_lnmax_has_no_release():
    params = ss.SmoothSensitivityParameters(order=8.0, beta=0.05, sigma_ss=5.0)
    report = analysis_report(build_mechanism("lnmax", laplace_scale=20.0), np.array([[250, 0]]), None, 1e-5,
                             smooth=params)
    release = report.estimate("smooth-sensitivity")
    assert release.details["available"] is False and release.epsilon is None
