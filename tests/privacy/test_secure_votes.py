"""PATE votes through the secure sum (privacy/secure_votes.py, the secure GNMax variants): exact
totals, masked shares that say nothing of the votes, and charges checked two independent ways —
against a hand transcription of Agarwal, Kairouz & Liu 2021, Cor. 3.6 at integer orders, and
against the exact Rényi divergence of a moved vote computed from the Skellam pmf.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats

from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp, gaussian_charge
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.skellam import skellam_rdp
from conclave.privacy.mechanisms import (ABSTAIN, SECURE_MECHANISMS, SecureConfidentGNMax, SecureGNMax,
                                         build_mechanism, secure_mechanism)
from conclave.privacy.noise import NoisePolicy
from conclave.privacy.secure_sum import MaskKeys, skellam_noise
from conclave.privacy.secure_votes import SkellamVotes, vote_release_charge

POLICY = NoisePolicy(insecure_seed=5)  # replayable noise: the test re-draws every party's share
OWNERS = ("a", "a", "b", "c")  # four teacher actors of three owners
TEACHERS = (3, 2, 4, 5)


def masks_for(parties: int, session: str = "round") -> list:
    keys = [MaskKeys(rank) for rank in range(parties)]
    public = [k.public_bytes for k in keys]
    return [k.pairwise_masks(public, session) for k in keys]


def partial_histograms(rng: np.random.Generator, batch: int, classes: int) -> list[np.ndarray]:
    """Each party's teachers vote once per query: int64 [batch, classes] per party."""
    return [np.stack([np.bincount(rng.integers(0, classes, t), minlength=classes) for _ in range(batch)])
            for t in TEACHERS]


def in_process_round(parts: list[np.ndarray], calls: list) -> callable:
    """``NoisedVotes`` over real shares computed in this process (every party's role in turn)."""
    def noised(rows: np.ndarray, sigma: float) -> np.ndarray:
        calls.append((rows.copy(), sigma))
        release = SkellamVotes(sigma)
        plan = release.plan(len(rows), parts[0].shape[1], OWNERS, TEACHERS)
        masks = masks_for(len(parts), f"round-{len(calls)}")
        shares = [release.share(part[rows], plan, OWNERS, masks[rank], POLICY.source(f"{len(calls)}/{rank}"))
                  for rank, part in enumerate(parts)]
        return release.total(shares, plan, len(rows))
    return noised


def test_the_decoded_total_is_the_clean_histogram_plus_every_partys_noise_share():
    batch, classes = 7, 4
    parts = partial_histograms(np.random.default_rng(0), batch, classes)
    release = SkellamVotes(3.0)
    plan = release.plan(batch, classes, OWNERS, TEACHERS)
    masks = masks_for(len(OWNERS))
    shares = [release.share(part, plan, OWNERS, masks[rank], POLICY.source(f"s/{rank}"))
              for rank, part in enumerate(parts)]
    variances = plan.party_variances(OWNERS)
    noise = sum(skellam_noise(plan.dimension, variances[rank], POLICY.source(f"s/{rank}"))
                for rank in range(len(OWNERS))).reshape(batch, classes)
    total = release.total(shares, plan, batch)
    np.testing.assert_array_equal(total, sum(parts) + noise)
    assert total.dtype == np.int64 and np.any(noise != 0)
    # Every owner faces σ² from the others' shares; the aggregator the whole O/(O − 1)·σ².
    for owner in set(OWNERS):
        others = sum(v for o, v in zip(OWNERS, variances) if o != owner)
        assert others == pytest.approx(9.0, rel=1e-9) and others >= 9.0
    assert plan.outsider_variance == pytest.approx(9.0 * 3 / 2)
    with pytest.raises(ValueError, match="without every share"):
        release.total(shares[:-1], plan, batch)


def test_a_share_is_uniform_on_the_ring_whatever_the_votes():
    """Fresh key pairs each round: one party's share has the same (uniform) distribution for
    opposite votes, so it says nothing about them."""
    batch, classes, rounds = 10, 5, 60
    release = SkellamVotes(2.0)
    owners, teachers = ("a", "b"), (6, 6)
    plan = release.plan(batch, classes, owners, teachers)
    all_first = np.zeros((batch, classes), dtype=np.int64)
    all_first[:, 0] = 6
    all_last = np.zeros((batch, classes), dtype=np.int64)
    all_last[:, -1] = 6
    seen = {}
    for name, votes in (("first", all_first), ("last", all_last)):
        values = [release.share(votes, plan, owners, masks_for(2, f"r{i}")[0], NoisePolicy().source("x"))
                  for i in range(rounds)]
        seen[name] = np.concatenate(values) / plan.modulus
    for values in seen.values():
        assert stats.kstest(values, "uniform").pvalue > 1e-3
    assert stats.ks_2samp(seen["first"], seen["last"]).pvalue > 1e-3


# --- the charge, against an independent transcription -------------------------------------


def corollary_3_6(alpha: int, l1: float, l2: float, mu: float) -> float:
    """Agarwal, Kairouz & Liu 2021, Cor. 3.6 at integer α ≥ 2, typed from the paper."""
    return alpha * l2**2 / (2 * mu) + min(((2 * alpha - 1) * l2**2 + 6 * l1) / (4 * mu**2), 3 * l1 / (2 * mu))


@pytest.mark.parametrize("sigma, batch", [(1.0, 1), (3.0, 17), (40.0, 250)])
def test_secure_gnmax_charges_b_times_the_skellam_curve_of_one_moved_vote(sigma, batch):
    charge = SecureGNMax(sigma).worst_case_charge(batch)
    assert charge.neighbouring == Neighbouring.ONE_VOTE
    np.testing.assert_allclose(charge.rdp, batch * skellam_rdp(DEFAULT_ORDERS, 2.0, math.sqrt(2), sigma**2),
                               rtol=1e-12)
    integer = DEFAULT_ORDERS == np.round(DEFAULT_ORDERS)
    by_hand = [batch * corollary_3_6(int(a), 2.0, math.sqrt(2), sigma**2) for a in DEFAULT_ORDERS[integer]]
    np.testing.assert_allclose(charge.rdp[integer], by_hand, rtol=1e-6)
    # Answers only: GNMax charges nothing for queries it does not answer (it answers every one).
    np.testing.assert_allclose(SecureGNMax(sigma).run_charge(batch, 0).rdp, 0.0)


def moved_vote_divergence(alpha: float, mu: float) -> float:
    """D_α of Sk(μ) shifted by (+1, −1) from Sk(μ) on two coordinates — the histogram of one query
    when one teacher's vote moves — summed from the pmf (independent coordinates add)."""
    k = np.arange(-2000, 2001)
    log_p = stats.skellam.logpmf(k, mu / 2, mu / 2)
    total = 0.0
    for shift in (1, -1):
        log_q = stats.skellam.logpmf(k - shift, mu / 2, mu / 2)  # the shifted distribution
        finite = np.isfinite(log_p) & np.isfinite(log_q)
        total += special.logsumexp(alpha * log_q[finite] + (1 - alpha) * log_p[finite]) / (alpha - 1)
    return float(total)


@pytest.mark.parametrize("sigma", [1.0, 2.5, 8.0])
def test_the_charge_bounds_the_exact_renyi_divergence_of_a_moved_vote(sigma):
    orders = np.array([1.5, 2.0, 3.0, 4.5, 8.0, 16.0, 32.0, 64.0])
    charge = SecureGNMax(sigma).worst_case_charge(1)
    bound = charge.rdp[np.searchsorted(DEFAULT_ORDERS, orders)]
    assert np.all(DEFAULT_ORDERS[np.searchsorted(DEFAULT_ORDERS, orders)] == orders)
    exact = np.array([moved_vote_divergence(a, sigma**2) for a in orders])
    assert np.all(exact <= bound * (1 + 1e-9)), (exact, bound)


def test_the_charge_is_close_to_the_exact_divergence_at_moderate_orders():
    """At σ = 8 the bound is within 5% of the truth at orders 3 to 8 (GNMax's working range)."""
    orders = np.array([3.0, 4.0, 5.0, 8.0])
    bound = SecureGNMax(8.0).worst_case_charge(1).rdp[np.searchsorted(DEFAULT_ORDERS, orders)]
    exact = np.array([moved_vote_divergence(a, 64.0) for a in orders])
    assert np.all(bound <= 1.05 * exact), (exact, bound)


def test_confident_gnmax_asks_round_two_only_for_queries_whose_noised_maximum_passes():
    batch, classes, threshold = 40, 3, 10.0
    parts = partial_histograms(np.random.default_rng(1), batch, classes)  # 14 teachers in all
    calls: list = []
    mechanism = SecureConfidentGNMax(sigma1=2.0, threshold=threshold, sigma2=1.5)
    labels = mechanism.answer(in_process_round(parts, calls), batch)
    (first, sigma1), *second = calls
    np.testing.assert_array_equal(first, np.arange(batch))
    assert sigma1 == 2.0 and len(second) <= 1
    answered = labels != ABSTAIN
    asked_again = second[0][0] if second else np.zeros(0, dtype=int)
    np.testing.assert_array_equal(np.flatnonzero(answered), asked_again)
    assert 0 < answered.sum() < batch  # the threshold sits inside the top counts' range (5 to 14)
    assert all(sigma == 1.5 for _, sigma in second) and np.all(labels[answered] < classes)
    charge = mechanism.run_charge(batch, int(answered.sum()))
    expected = (batch * skellam_rdp(DEFAULT_ORDERS, 2.0, math.sqrt(2), 4.0)
                + answered.sum() * skellam_rdp(DEFAULT_ORDERS, 2.0, math.sqrt(2), 2.25))
    np.testing.assert_allclose(charge.rdp, expected, rtol=1e-12)
    np.testing.assert_allclose(mechanism.worst_case_charge(batch).rdp, mechanism.run_charge(batch, batch).rdp)


def test_the_threshold_step_costs_about_twice_the_clean_modes():
    """docs/privacy.md quotes these: the demo's σ1 = 20 over 300 queries at δ = 1e-5."""
    def epsilon(charge) -> float:
        return epsilon_from_rdp(charge.orders, charge.rdp, 1e-5)[0]

    clean = epsilon(gaussian_charge(20.0, count=300, label="threshold", neighbouring=Neighbouring.ONE_VOTE))
    secure = epsilon(vote_release_charge(20.0, 300, "threshold"))
    assert (round(clean, 2), round(secure, 2)) == (4.01, 6.02)
    assert round(epsilon(vote_release_charge(20.0 * math.sqrt(2), 300, "threshold")), 2) == 4.02
    demo = build_mechanism("confident-gnmax", sigma1=20.0, threshold=30.0, sigma2=12.0)
    assert (round(epsilon(demo.run_charge(300, 300)), 2),
            round(epsilon(secure_mechanism(demo).run_charge(300, 300)), 2)) == (12.17, 13.39)


def test_secure_variants_take_the_same_parameters():
    assert SECURE_MECHANISMS == ("gnmax", "confident-gnmax", "private-knn", "public-clusters")
    assert secure_mechanism(build_mechanism("gnmax", sigma=7.0)) == SecureGNMax(7.0)
    assert secure_mechanism(build_mechanism("confident-gnmax", sigma1=5.0, threshold=3.0, sigma=2.0)) == \
        SecureConfidentGNMax(5.0, 3.0, 2.0)


@pytest.mark.parametrize("name, params", [("lnmax", {"laplace_scale": 2.0}),
                                          ("nzc", {"constant": 1.0, "sigma": 1.0}),
                                          ("stability", {"epsilon": 1.0, "delta": 1e-5, "max_unstable": 5})])
def test_mechanisms_that_need_clean_votes_are_refused_in_one_line(name, params):
    mechanism = build_mechanism(name, **params)
    with pytest.raises(ValueError, match="use one of gnmax, confident-gnmax, private-knn, public-clusters") as refused:
        secure_mechanism(mechanism)
    assert "\n" not in str(refused.value) and name in str(refused.value)
