"""PATE data-dependent accounting checked against independently worked values.

Independent values come from closed forms, limits, and the papers' formulas evaluated
directly with mpmath at 50 digits (written out here from the theorem statements, not
from our implementation).
"""
from __future__ import annotations

import math

import mpmath as mp
import numpy as np
import pytest

from conclave.privacy.accounting import pate, pld
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp
from conclave.privacy.accounting.report import analysis_report
from conclave.privacy.accounting.smooth_sensitivity import SmoothSensitivityParameters
from conclave.privacy.mechanisms import build_mechanism
from conclave.privacy.noise import NoisePolicy

mp.mp.dps = 50
ORDERS = np.array([1.5, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0])


# --- formulas written out from the papers, in mpmath --------------------------------------


def mp_gnmax_q(votes, sigma):
    """PATE 2018 Prop 7: Σ_{j≠j*} Pr[N(0, 2σ²) ≥ n_j* − n_j] = Σ ½ erfc(gap / (2σ))."""
    top = int(np.argmax(votes))
    return sum(mp.erfc(mp.mpf(int(votes[top] - v)) / (2 * sigma)) / 2 for j, v in enumerate(votes) if j != top)


def mp_theorem6(q, sigma, order):
    """PATE 2018 Thm 6 with Prop 10's μ₂ = σ√log(1/q), μ₁ = μ₂ + 1."""
    q = mp.mpf(q)
    mu2 = sigma * mp.sqrt(mp.log(1 / q))
    mu1 = mu2 + 1
    eps1, eps2 = mu1 / sigma**2, mu2 / sigma**2
    a = (1 - q) / (1 - (q * mp.e**eps2) ** ((mu2 - 1) / mu2))
    b = mp.e**eps1 / q ** (1 / (mu1 - 1))
    return mp.log((1 - q) * a ** (order - 1) + q * b ** (order - 1)) / (order - 1)


def mp_lnmax_q(votes, b):
    """PATE 2017 Lemma 4 with γ = 1/b: Σ_{j≠j*} (2 + γΔ)/(4 e^{γΔ})."""
    top = int(np.argmax(votes))
    gamma = 1 / mp.mpf(b)
    return sum(
        (2 + gamma * int(votes[top] - v)) / (4 * mp.e ** (gamma * int(votes[top] - v)))
        for j, v in enumerate(votes)
        if j != top
    )


def mp_theorem3(q, b, order):
    """PATE 2017 Thm 3 (moments at l = λ − 1, divided by l), with ε₀ = 2/b."""
    q, eps0, l = mp.mpf(q), 2 / mp.mpf(b), order - 1
    return mp.log((1 - q) * ((1 - q) / (1 - mp.e**eps0 * q)) ** l + q * mp.e ** (eps0 * l)) / l


# --- closed forms ---------------------------------------------------------------------------


def test_gnmax_data_independent_epsilon_matches_the_analytic_optimum():
    # T answers of GNMax(σ): RDP Tλ/σ²; classic ε(λ) = Tλ/σ² + log(1/δ)/(λ−1) is smallest at
    # λ* = 1 + σ·sqrt(log(1/δ)/T), where ε* = T/σ² + 2·sqrt(T·log(1/δ))/σ.
    sigma, queries, delta = 40.0, 300, 1e-5
    best_order = 1 + sigma * math.sqrt(math.log(1 / delta) / queries)
    expected = queries / sigma**2 + 2 * math.sqrt(queries * math.log(1 / delta)) / sigma
    orders = np.array([2.0, best_order - 1, best_order, best_order + 1, 200.0])
    curve = queries * pate.gnmax_rdp_data_independent(sigma, orders)
    assert curve == pytest.approx(queries * orders / sigma**2, rel=1e-12)
    epsilon, order = epsilon_from_rdp(orders, curve, delta, conversion="classic")
    assert epsilon == pytest.approx(expected, rel=1e-12) and order == pytest.approx(best_order)
    # the run's guarantee (worst case of the file's queries, tight conversion on the ledger's
    # grid) never loses to the classic optimum
    report = analysis_report(build_mechanism("gnmax", sigma=sigma), np.tile([250, 0, 0], (queries, 1)), None, delta)
    assert report.guarantee.basis == "worst-case" and report.guarantee.epsilon < expected
    rdp = epsilon_from_rdp(DEFAULT_ORDERS, queries * DEFAULT_ORDERS / sigma**2, delta)[0]
    # ... nor to the RDP figure: the fixed plan's Gaussians compose into one, whose exact curve is smaller
    exact = pld.analytic_gaussian_epsilon(sigma / math.sqrt(2 * queries), delta)
    assert report.guarantee.epsilon == pytest.approx(exact, rel=1e-12) and exact < rdp


def test_lnmax_data_independent_is_min_of_zcdp_and_pure_bounds():
    b = 20.0  # PATE 2017 MNIST: γ = 0.05, ε₀ = 0.1
    assert pate.lnmax_rdp_data_independent(b, ORDERS) == pytest.approx(np.minimum(ORDERS * 0.1**2 / 2, 0.1))


# --- formulas against mpmath ---------------------------------------------------------------


@pytest.mark.parametrize(
    "votes,sigma",
    [([200, 30, 20, 0, 0], 40.0), ([150, 60, 40, 0], 40.0), ([120, 100, 30], 20.0), ([250, 0, 0, 0, 0, 0, 0, 0, 0, 0], 40.0)],
)
def test_gnmax_q_bound_and_theorem6_match_mpmath(votes, sigma):
    votes = np.array(votes)
    q = mp_gnmax_q(votes, sigma)
    logq = pate.gnmax_logq(votes[None, :], sigma)[0]
    assert logq == pytest.approx(float(mp.log(q)), rel=1e-10)
    raw = pate.gnmax_theorem6(logq, sigma, ORDERS)[0]
    assert raw == pytest.approx([float(mp_theorem6(q, sigma, lam)) for lam in ORDERS], rel=1e-8)
    bound = pate.gnmax_rdp(logq, sigma, ORDERS)[0]
    applies = pate.gnmax_theorem6_applies(logq, sigma, ORDERS)[0]
    expected = np.where(applies, np.minimum(raw, ORDERS / sigma**2), ORDERS / sigma**2)
    assert bound == pytest.approx(expected, rel=1e-12)


def test_gnmax_data_dependent_value_at_a_worked_point():
    # votes [200, 30, 20, 0...] at σ = 40: q = ½erfc(170/80) + ½erfc(180/80) + 7·½erfc(200/80)
    votes = np.array([200, 30, 20, 0, 0, 0, 0, 0, 0, 0])
    q = sum(float(mp.erfc(mp.mpf(g) / 80)) / 2 for g in (170, 180) + (200,) * 7)
    assert math.exp(pate.gnmax_logq(votes, 40.0)[0]) == pytest.approx(q, rel=1e-10)
    value = pate.gnmax_rdp(math.log(q), 40.0, [10.0])[0, 0]
    assert value == pytest.approx(float(mp_theorem6(q, 40.0, 10.0)), rel=1e-8)
    assert value < 10.0 / 40.0**2 / 5  # more than 5× below the data-independent cost


@pytest.mark.parametrize("votes,b", [([200, 30, 20, 0], 20.0), ([100, 90, 60], 20.0), ([240, 10], 10.0)])
def test_lnmax_lemma4_and_theorem3_match_mpmath(votes, b):
    votes = np.array(votes)
    q = min(mp_lnmax_q(votes, b), 1 - mp.mpf(1) / len(votes))
    logq = pate.lnmax_logq(votes[None, :], b)[0]
    assert logq == pytest.approx(float(mp.log(q)), rel=1e-10)
    eps0 = 2 / b
    expected = np.minimum(ORDERS * eps0**2 / 2, eps0)
    if q <= 1 / (mp.e**eps0 + 1):
        expected = np.minimum(expected, [float(mp_theorem3(q, b, lam)) for lam in ORDERS])
    assert pate.lnmax_rdp(logq, b, ORDERS)[0] == pytest.approx(expected, rel=1e-8)


def test_q_bounds_are_capped_at_one_minus_one_over_k():
    tie = np.array([[50, 50, 50, 50]])  # the union bound alone would exceed 1
    assert math.exp(pate.gnmax_logq(tie, 40.0)[0]) == pytest.approx(0.75)
    assert math.exp(pate.lnmax_logq(tie, 20.0)[0]) == pytest.approx(0.75)


# --- the bounds bound the real thing ------------------------------------------------------


def mp_renyi(p, q, order):
    return mp.log(sum(pi**order * qi ** (1 - order) for pi, qi in zip(p, q))) / (order - 1)


def two_class_gnmax(n0, n1, sigma):
    first = mp.ncdf(mp.mpf(n0 - n1) / (mp.sqrt(2) * sigma))  # Pr[n0 + Z0 > n1 + Z1]
    return [first, 1 - first]


def two_class_lnmax(n0, n1, b):
    t = mp.mpf(abs(n0 - n1)) / b
    tail = mp.e ** (-t) * (1 + t / 2) / 2  # Pr[L1 − L0 ≥ |gap|] for iid Laplace(b)
    first = 1 - tail if n0 >= n1 else tail
    return [first, 1 - first]


@pytest.mark.parametrize("name", ["gnmax", "lnmax"])
def test_exact_renyi_divergence_to_every_neighbour_is_below_the_data_dependent_bound(name):
    # Two classes: the output distribution is exact in closed form, so D_λ(M(D) ‖ M(D')) for
    # both neighbours D' (one teacher switches) can be computed and compared with the bound at D.
    teachers, scale, orders = 60, (5.0 if name == "gnmax" else 3.0), [1.5, 2.0, 5.0, 10.0, 20.0, 50.0]
    outputs = two_class_gnmax if name == "gnmax" else two_class_lnmax
    tightest = 0.0
    for n0 in range(30, teachers + 1):
        votes = np.array([[n0, teachers - n0]])
        if name == "gnmax":
            bound = pate.gnmax_rdp(pate.gnmax_logq(votes, scale), scale, orders)[0]
        else:
            bound = pate.lnmax_rdp(pate.lnmax_logq(votes, scale), scale, orders)[0]
        for m0 in (n0 - 1, n0 + 1):
            if not 0 <= m0 <= teachers:
                continue
            for order, limit in zip(orders, bound):
                exact = float(mp_renyi(outputs(n0, teachers - n0, scale), outputs(m0, teachers - m0, scale), order))
                assert exact <= limit * (1 + 1e-9)
                tightest = max(tightest, exact / limit)
    assert tightest > 0.5  # the bound is not loose to the point of meaninglessness


def test_threshold_step_bound_covers_the_exact_divergence():
    # the threshold step's output is Bernoulli(p), p = Pr[m + N(0, σ1²) ≥ T]; a neighbour has m ± 1
    threshold, sigma1, orders = 30.0, 4.0, [1.5, 2.0, 5.0, 10.0, 20.0]

    def answered(m):
        p = mp.ncdf((m - threshold) / sigma1)
        return [p, 1 - p]

    tightest = 0.0
    for m in range(20, 61):  # 60 teachers, 3 classes: the top count m is at least 20
        votes = np.array([[m, 60 - m, 0]]) if m >= 30 else np.array([[m, m, 60 - 2 * m]])
        bound = pate.threshold_rdp(pate.threshold_logq(votes, threshold, sigma1), sigma1, orders)[0]
        for neighbour in (m - 1, m + 1):
            for order, limit in zip(orders, bound):
                exact = float(mp_renyi(answered(m), answered(neighbour), order))
                assert exact <= limit * (1 + 1e-9)
                tightest = max(tightest, exact / limit)
    assert tightest > 0.5


# --- limits --------------------------------------------------------------------------------


def test_q_zero_costs_nothing():
    assert np.all(pate.gnmax_rdp(-np.inf, 40.0, ORDERS) == 0)
    assert np.all(pate.lnmax_rdp(-np.inf, 20.0, ORDERS) == 0)
    assert np.all(pate.threshold_rdp(-np.inf, 150.0, ORDERS) == 0)
    one_class = np.array([[250], [10]])  # a single class: the answer is fixed
    assert np.all(pate.gnmax_rdp(pate.gnmax_logq(one_class, 40.0), 40.0, ORDERS) == 0)


def test_cost_vanishes_as_q_goes_to_zero():
    values = [pate.gnmax_rdp(logq, 40.0, [20.0])[0, 0] for logq in (-10, -20, -50, -200)]
    assert all(a > b for a, b in zip(values, values[1:]))
    assert values[-1] < 1e-60


def test_large_q_falls_back_to_data_independent():
    for logq in (math.log(0.5), math.log(0.1), -1.0):
        assert pate.gnmax_rdp(logq, 40.0, ORDERS)[0] == pytest.approx(ORDERS / 40.0**2)
        assert pate.threshold_rdp(logq, 150.0, ORDERS)[0] == pytest.approx(ORDERS / (2 * 150.0**2))
    assert pate.lnmax_rdp(math.log(0.5), 20.0, ORDERS)[0] == pytest.approx(np.minimum(ORDERS * 0.01 / 2, 0.1))


def test_prop10_conditions_fail_and_the_bound_is_data_independent():
    sigma, orders = 40.0, np.array([10.0, 100.0])
    # log q = −1: μ₂ = 40, −log q = 1 < ε₂ = 1: the q condition fails at every order, although
    # the raw Theorem 6 expression would claim less than λ/σ² at λ = 100.
    assert not pate.gnmax_theorem6_applies(-1.0, sigma, orders).any()
    assert pate.gnmax_theorem6(-1.0, sigma, orders)[0, 1] < 100 / sigma**2
    assert pate.gnmax_rdp(-1.0, sigma, orders)[0] == pytest.approx(orders / sigma**2)
    # log q = −5: μ₁ = 40√5 + 1 ≈ 90.4 < λ = 100: the order condition fails at λ = 100 only.
    applies = pate.gnmax_theorem6_applies(-5.0, sigma, orders)[0]
    assert applies.tolist() == [True, False]
    assert pate.gnmax_theorem6(-5.0, sigma, orders)[0, 1] < 100 / sigma**2
    assert pate.gnmax_rdp(-5.0, sigma, orders)[0, 1] == pytest.approx(100 / sigma**2)
    assert pate.gnmax_rdp(-5.0, sigma, orders)[0, 0] < 10 / sigma**2


def test_threshold_log_q_takes_the_rarer_outcome():
    votes = np.array([[250, 0], [200, 50], [100, 150]])
    gap = 200.0 - votes.max(axis=1)
    p = np.array([float(mp.ncdf(-g / 150)) for g in gap])
    expected = np.log(np.minimum(p, 1 - p))
    assert pate.threshold_logq(votes, 200.0, 150.0) == pytest.approx(expected, rel=1e-10)


# --- monotonicity --------------------------------------------------------------------------


def test_data_dependent_cost_decreases_with_the_vote_gap():
    gaps = range(0, 251, 10)
    votes = np.array([[(250 + g) // 2, (250 - g) // 2, 0] for g in gaps])
    for name, rows in (
        ("gnmax", pate.gnmax_rdp(pate.gnmax_logq(votes, 40.0), 40.0, ORDERS)),
        ("lnmax", pate.lnmax_rdp(pate.lnmax_logq(votes, 20.0), 20.0, ORDERS)),
    ):
        assert np.all(np.diff(rows, axis=0) <= 1e-15), name
        assert np.all(rows[-1][:5] < rows[0][:5] / 10), name  # λ ≤ 20: a unanimous vote costs < 1/10


def test_cost_decreases_with_sigma_at_a_fixed_q_bound_and_data_independently():
    sigmas = (10.0, 20.0, 30.0, 40.0, 60.0, 100.0, 200.0)
    for logq in (-3.0, -8.0, -20.0, -50.0):
        rows = np.array([pate.gnmax_rdp(logq, s, ORDERS)[0] for s in sigmas])
        assert np.all(np.diff(rows, axis=0) <= 0), logq
    rng = np.random.default_rng(3)
    top = rng.integers(150, 250, size=100)
    votes = np.stack([top, 250 - top, np.zeros_like(top)], axis=1)
    reports = [analysis_report(build_mechanism("gnmax", sigma=s), votes, None, 1e-5) for s in sigmas]
    independent = [r.guarantee.epsilon for r in reports]
    assert all(a > b for a, b in zip(independent, independent[1:]))
    # At fixed votes the data-dependent ε is NOT monotone in σ: less noise also shrinks q.
    # (σ = 10 costs less than σ = 30 on these confident votes.) Nothing here pretends otherwise.
    dependent = [r.estimate("data-dependent").epsilon for r in reports]
    assert dependent[0] < dependent[2]
    # in the same accounting (RDP at the same orders) the data-dependent figure never exceeds the independent one
    independent_rdp = [epsilon_from_rdp(DEFAULT_ORDERS, 100 * DEFAULT_ORDERS / s**2, 1e-5)[0] for s in sigmas]
    assert all(d <= i + 1e-12 for d, i in zip(dependent, independent_rdp))


# --- run-level accounting ------------------------------------------------------------------


def test_confident_gnmax_charges_threshold_on_every_query_and_gnmax_on_answered():
    votes = np.array([[240, 10, 0], [120, 100, 30], [90, 80, 80], [250, 0, 0]])
    answered = np.array([True, False, False, True])
    mech = build_mechanism("confident-gnmax", sigma1=150.0, threshold=200.0, sigma=40.0)
    realised = mech.run_charge(4, 2)
    assert realised.rdp == pytest.approx(4 * DEFAULT_ORDERS / (2 * 150.0**2) + 2 * DEFAULT_ORDERS / 40.0**2)
    threshold = pate.threshold_rdp(pate.threshold_logq(votes, 200.0, 150.0), 150.0, ORDERS).sum(axis=0)
    gnmax = pate.gnmax_rdp(pate.gnmax_logq(votes[answered], 40.0), 40.0, ORDERS).sum(axis=0)
    assert mech.data_dependent_rdp(votes, answered, ORDERS).sum(axis=0) == pytest.approx(threshold + gnmax)
    none = mech.data_dependent_rdp(votes, np.zeros(4, dtype=bool), ORDERS).sum(axis=0)
    assert none == pytest.approx(threshold)


def test_mask_limits_gnmax_charges_to_answered_queries():
    votes = np.array([[240, 10, 0]] * 5)
    mech = build_mechanism("gnmax", sigma=40.0)
    every = mech.data_dependent_rdp(votes, np.ones(5, dtype=bool), ORDERS).sum(axis=0)
    two = mech.data_dependent_rdp(votes, np.array([True, True, False, False, False]), ORDERS).sum(axis=0)
    assert two == pytest.approx(every * 2 / 5)
    assert mech.run_charge(5, 2).rdp == pytest.approx(2 * DEFAULT_ORDERS / 40.0**2)


def mnist_like_votes(rng: np.random.Generator, queries: int = 640, teachers: int = 250, classes: int = 10):
    """Histograms with PATE-2018-MNIST-like strong consensus: the plurality holds 60–100% of votes."""
    votes = np.zeros((queries, classes), dtype=np.int64)
    share = rng.uniform(0.6, 1.0, size=queries)
    for row, p in zip(votes, share):
        top = rng.binomial(teachers, p)
        label = rng.integers(classes)
        row[np.arange(classes) != label] = rng.multinomial(teachers - top, np.full(classes - 1, 1 / (classes - 1)))
        row[label] = top
    return votes


def test_mnist_settings_data_dependent_far_below_the_guarantee():
    rng = np.random.default_rng(2018)
    votes = mnist_like_votes(rng)
    answered = votes.max(axis=1) + rng.normal(0, 150, size=len(votes)) >= 200  # the threshold step
    mech = build_mechanism("confident-gnmax", sigma1=150.0, threshold=200.0, sigma=40.0)
    smooth = SmoothSensitivityParameters(order=15.0, beta=0.4 / 15.0, sigma_ss=6.0)  # fixed in advance
    report = analysis_report(mech, votes, answered, 1e-5, smooth=smooth, conversion="classic",
                             noise=NoisePolicy(insecure_seed=1))
    assert report.queries == 640 and report.answered == int(answered.sum())
    # the guarantee: all 640 queries answered, plus the release's own cost, composed in RDP
    planned = 640 * DEFAULT_ORDERS / (2 * 150.0**2) + 640 * DEFAULT_ORDERS / 40.0**2 + smooth.charge(DEFAULT_ORDERS).rdp
    assert report.guarantee.epsilon == pytest.approx(epsilon_from_rdp(DEFAULT_ORDERS, planned, 1e-5)[0], rel=1e-12)
    dependent = report.estimate("data-dependent")
    assert dependent.private and dependent.epsilon < 0.5 * report.guarantee.epsilon
    released = report.estimate("smooth-sensitivity")
    assert not released.private and released.details["available"]
    # the released figure is the private one plus the release's cost and noise, at the fixed order
    exact = mech.data_dependent_rdp(votes, answered, np.array([15.0])).sum()
    assert abs(released.details["released_rdp"] - exact) < 2.0
    assert released.epsilon == pytest.approx(
        released.details["released_rdp"] + released.details["release_rdp_cost"] + math.log(1e5) / 14)
    public = report.public()
    assert [e["name"] for e in public["estimates"]] == ["smooth-sensitivity"]  # the private figure stays home
    assert "smooth_sensitivity" not in json_keys(public) and "noise_std" not in json_keys(public)
    assert not report.sound and "insecure_noise_seed" in report.guarantee.unsound_reasons[0]


def json_keys(node) -> set[str]:
    if isinstance(node, dict):
        return set(node) | {k for v in node.values() for k in json_keys(v)}
    if isinstance(node, list):
        return {k for v in node for k in json_keys(v)}
    return set()


# --- NZC and stability ---------------------------------------------------------------------


def test_nzc_report_is_unbounded_beside_the_papers_claim():
    votes = np.array([[130, 120, 0], [200, 50, 0]])
    report = analysis_report(build_mechanism("nzc", constant=1000.0, laplace_scale=20.0), votes, None, 1e-5)
    assert not report.sound and math.isinf(report.guarantee.epsilon) and report.guarantee.unsound_reasons
    claim = report.estimate("paper-claim")
    assert claim.details["epsilon_per_query"] == pytest.approx(0.1)  # Theorem 4: 2γ = 2/b
    # T = 2 answers: the smaller of basic composition (2·2γ) and the advanced composition the
    # paper states, 4Tγ² + 2γ·sqrt(2T·log(1/δ))
    advanced = 4 * 2 * 0.05**2 + 0.1 * math.sqrt(4 * math.log(1e5))
    assert claim.epsilon == pytest.approx(min(0.2, advanced))
    assert "NOT" in claim.source and claim.as_dict()["label"] == "estimate: not a DP guarantee"


def test_stability_report_carries_its_epsilon_delta():
    mech = build_mechanism("stability", epsilon=2.0, delta=1e-6, max_unstable=50)
    report = analysis_report(mech, np.array([[250, 0], [130, 120]]), None, 1e-5)
    assert report.sound and report.estimates == ()
    # the whole run's (2, 1e-6) is charged once; the guarantee converts it at δ − 1e-6
    charge = mech.run_charge(2, 2)
    assert charge.extra_delta == 1e-6
    assert report.guarantee.epsilon == pytest.approx(epsilon_from_rdp(DEFAULT_ORDERS, charge.rdp, 9e-6)[0])
    # composed as RDP on a finite grid, pure ε = 2 converts to 2 plus a hair at the top order 8192
    assert 2.0 <= report.guarantee.epsilon < 2.0 + 1e-3


def test_a_budget_is_only_a_would_have_fitted_check():
    votes = mnist_like_votes(np.random.default_rng(5), queries=300)
    mech = build_mechanism("gnmax", sigma=40.0)
    worst = analysis_report(mech, votes, None, 1e-5).guarantee
    roomy = analysis_report(mech, votes, None, 1e-5, budget_check=worst.epsilon + 1.0)
    assert roomy.details["budget_check"]["fits"] and roomy.guarantee == worst
    for_100 = 1.05 * epsilon_from_rdp(DEFAULT_ORDERS, mech.run_charge(100, 100).rdp, 1e-5)[0]  # the filter is RDP
    tight = analysis_report(mech, votes, np.arange(300) < 100, 1e-5, budget_check=for_100)
    assert tight.details["budget_check"]["fits"]  # 100 of 300 answered: a filter sized for 100 would have admitted them
    # ... but none was in force while they were released: a post-hoc fit is not a filter
    assert tight.guarantee.basis == "worst-case" and tight.details["budget_check"]["kind"] == "would-have-fitted"
    over = analysis_report(mech, votes, None, 1e-5, budget_check=for_100)
    assert not over.details["budget_check"]["fits"] and over.guarantee == worst


# --- input checks --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "votes,answered,message",
    [
        (np.array([[1.5, 2.0]]), None, "integer"),
        (np.array([[3, -1]]), None, "non-negative"),
        (np.zeros((0, 3), dtype=int), None, "empty"),
        (np.array([1, 2, 3]), None, "2-D"),
        (np.array([[1, 2], [3, 4]]), np.array([True]), "shape"),
        (np.array([[1, 2], [3, 4]]), np.array([1, 0]), "boolean"),
    ],
)
def test_bad_votes_are_rejected_with_a_message(votes, answered, message):
    with pytest.raises(ValueError, match=message):
        analysis_report(build_mechanism("gnmax", sigma=40.0), votes, answered, 1e-5)
