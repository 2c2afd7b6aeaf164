"""DP-PCA and noisy counts through the secure sum: exact totals, planned noise, masked shares, charges.

The charges are checked against an independent mpmath transcription of the Skellam bound
(Agarwal, Kairouz & Liu 2021, Cor. 3.6) on the ledger's grid of orders, interpolated between
integer orders as privacy.accounting.skellam says ((α − 1)·ε(α) linear, 0 at α = 1).
"""
from __future__ import annotations

import math

import mpmath as mp
import numpy as np
import pytest
from scipy import stats

from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp
from conclave.privacy.accounting.skellam import skellam_rdp
from conclave.privacy.counts import SkellamCounts
from conclave.privacy.noise import NoisePolicy
from conclave.privacy.pca import (
    SecureAnalyzeGauss,
    covariance_sum,
    symmetric_from_upper,
    top_components,
    upper_triangle,
)
from conclave.privacy.secure_release import summed_shares
from conclave.privacy.secure_sum import MaskKeys, decode_integers, quantize, skellam_noise

DELTA = 1e-5
POLICY = NoisePolicy(insecure_seed=11)  # replayable noise: the test re-draws every party's share


def masks_for(parties: int, session: str = "test") -> list:
    keys = [MaskKeys(rank) for rank in range(parties)]
    public = [k.public_bytes for k in keys]
    return [k.pairwise_masks(public, session) for k in keys]


def replayed_noise(plan, owners, stream: str) -> list[np.ndarray]:
    variances = plan.party_variances(owners)
    return [skellam_noise(plan.dimension, variances[rank], POLICY.source(f"{stream}-{rank}"))
            for rank in range(len(owners))]


# --- independent transcription of the charge ----------------------------------------------


def corollary_3_6(alpha: int, l1, l2, mu) -> mp.mpf:
    """ε(α) = α·Δ₂²/(2μ) + min(((2α − 1)·Δ₂² + 6·Δ₁)/(4μ²), 3·Δ₁/(2μ)), integer α ≥ 2."""
    l1, l2, mu = mp.mpf(l1), mp.mpf(l2), mp.mpf(mu)
    return alpha * l2**2 / (2 * mu) + min(((2 * alpha - 1) * l2**2 + 6 * l1) / (4 * mu**2), 3 * l1 / (2 * mu))


def on_orders(orders, l1, l2, mu) -> np.ndarray:
    out = []
    with mp.workdps(40):
        for alpha in orders:
            lo, hi = math.floor(alpha), math.ceil(alpha)
            if lo == hi:
                out.append(corollary_3_6(lo, l1, l2, mu))
                continue
            t = mp.mpf(alpha) - lo
            cumulant_lo = (lo - 1) * corollary_3_6(lo, l1, l2, mu) if lo >= 2 else mp.mpf(0)
            out.append(((1 - t) * cumulant_lo + t * (hi - 1) * corollary_3_6(hi, l1, l2, mu)) / (mp.mpf(alpha) - 1))
    return np.array([float(v) for v in out])


@pytest.mark.parametrize("epsilon", [0.1, 0.3, 1.0])
def test_charges_match_an_independent_transcription_and_give_the_configured_epsilon(epsilon):
    pca, counts = SecureAnalyzeGauss(epsilon, DELTA), SkellamCounts(epsilon, DELTA)
    z_pca, z_counts = pca.noise_multiplier, counts.noise_multiplier
    expected = {"dp-pca": on_orders(DEFAULT_ORDERS, 21, 21, (21 * z_pca) ** 2),
                "noisy-counts": on_orders(DEFAULT_ORDERS, 1, 1, z_counts**2)}
    for mechanism in (pca, counts):
        charge = mechanism.charge()
        np.testing.assert_array_equal(charge.orders, DEFAULT_ORDERS)
        np.testing.assert_allclose(charge.rdp, expected[charge.label], rtol=1e-6)
        eps = epsilon_from_rdp(charge.orders, charge.rdp, DELTA)[0]
        assert eps <= epsilon and eps == pytest.approx(epsilon, rel=1e-4)
    # not wasteful: a multiplier 10⁻⁵ smaller already overshoots the target
    assert epsilon_from_rdp(DEFAULT_ORDERS, on_orders(DEFAULT_ORDERS, 1, 1, (z_counts * (1 - 1e-5)) ** 2),
                            DELTA)[0] > epsilon


@pytest.mark.parametrize("dimension, owners", [(1, ("a", "b")), (8, ("a", "b", "c")), (32, ("a", "a", "b")),
                                               (100, ("a", "b", "c", "d"))])
def test_every_accepted_plan_costs_at_most_the_charge(dimension, owners):
    pca = SecureAnalyzeGauss(0.3, DELTA)
    plan = pca.plan(dimension, owners, norm_bound=10_000)
    assert plan.dimension == dimension * (dimension + 1) // 2
    assert math.sqrt(plan.dimension) <= plan.rounding_inflation * plan.scale  # the scale the charge assumes
    cost = skellam_rdp(DEFAULT_ORDERS, plan.l1_sensitivity, plan.l2_sensitivity, plan.noise_variance)
    assert np.all(cost <= pca.charge().rdp)
    counts = SkellamCounts(0.5, DELTA)
    counts_plan = counts.plan(50, owners, norm_bound=10_000)
    assert (counts_plan.l1_sensitivity, counts_plan.l2_sensitivity) == (1, 1)
    assert counts_plan.noise_variance == pytest.approx(counts.noise_multiplier**2)
    np.testing.assert_allclose(skellam_rdp(DEFAULT_ORDERS, 1, 1, counts_plan.noise_variance), counts.charge().rdp)


def test_the_secure_covariance_total_is_the_parts_plus_the_noise_shares_exactly():
    rng = np.random.default_rng(0)
    owners = ("a", "b", "b")
    pca = SecureAnalyzeGauss(1.0, DELTA)
    plan = pca.plan(6, owners, norm_bound=1000)
    parts = [covariance_sum(rng.normal(size=(n, 6))) for n in (40, 25, 60)]
    masks = masks_for(3)
    shares = [pca.share(part, plan, owners, masks[rank], POLICY.source(f"pca-{rank}"))
              for rank, part in enumerate(parts)]
    noise = replayed_noise(plan, owners, "pca")
    quantized = [quantize(upper_triangle(part), plan) for part in parts]
    for share, q, n in zip(shares, quantized, noise):
        assert share.min() >= 0 and share.max() < plan.modulus
        assert np.all(share != (q + n) % plan.modulus)  # masked: not its quantized part plus noise
    total = decode_integers(summed_shares(shares, plan), plan)
    np.testing.assert_array_equal(total, sum(quantized) + sum(noise))  # the masks cancel exactly
    # the decoded total is the sum of the parts (up to rounding, W/2 per entry) plus the noise
    clean = (total - sum(noise)) / plan.scale
    assert np.max(np.abs(clean - upper_triangle(sum(parts)))) <= 3 * 0.5 / plan.scale
    released = pca.release(shares, 3, plan)
    np.testing.assert_array_equal(released, top_components(symmetric_from_upper(total / plan.scale), 3))
    assert released.shape == (6, 3)


def test_the_secure_counts_total_is_the_parts_plus_the_noise_shares_exactly():
    rng = np.random.default_rng(1)
    owners = ("a", "b", "c")
    counts = SkellamCounts(0.5, DELTA)
    plan = counts.plan(30, owners, norm_bound=500)
    parts = [rng.integers(0, 5, size=30) for _ in owners]
    masks = masks_for(3)
    shares = [counts.share(part, plan, owners, masks[rank], POLICY.source(f"counts-{rank}"))
              for rank, part in enumerate(parts)]
    released = counts.release(shares, plan)
    assert released.dtype == np.int64
    np.testing.assert_array_equal(released, sum(parts) + sum(replayed_noise(plan, owners, "counts")))


def test_the_noise_has_the_planned_variance_for_whoever_sums_and_for_a_curious_owner():
    owners = ("a", "b", "c")
    for mechanism, plan, parts in (
            (SecureAnalyzeGauss(1.0, DELTA), SecureAnalyzeGauss(1.0, DELTA).plan(100, owners, 300),
             [np.zeros((100, 100))] * 3),
            (SkellamCounts(1.0, DELTA), SkellamCounts(1.0, DELTA).plan(5000, owners, 300),
             [np.zeros(5000, dtype=np.int64)] * 3)):
        masks = masks_for(3)
        policy = NoisePolicy()  # OS entropy
        shares = [mechanism.share(part, plan, owners, masks[rank], policy.source("x"))
                  for rank, part in enumerate(parts)]
        total = decode_integers(summed_shares(shares, plan), plan).astype(float)
        assert plan.dimension >= 5000
        assert total.var() == pytest.approx(plan.outsider_variance, rel=0.08)  # 1.5·μ for three owners
        assert plan.outsider_variance == pytest.approx(1.5 * plan.noise_variance)


def test_what_a_curious_owner_does_not_know_has_the_charged_variance():
    owners = ("a", "b", "c")
    counts = SkellamCounts(1.0, DELTA)
    plan = counts.plan(6000, owners, 300)
    masks = masks_for(3)
    shares = [counts.share(np.zeros(6000, dtype=np.int64), plan, owners, masks[rank], POLICY.source(f"owner-{rank}"))
              for rank in range(3)]
    own_noise = replayed_noise(plan, owners, "owner")[0]
    unknown_to_a = decode_integers(summed_shares(shares, plan), plan) - own_noise
    assert unknown_to_a.var() == pytest.approx(plan.noise_variance, rel=0.08)
    assert plan.noise_variance == pytest.approx(counts.noise_multiplier**2)


def test_a_share_alone_is_uniform_on_the_ring():
    rng = np.random.default_rng(2)
    pca = SecureAnalyzeGauss(1.0, DELTA)
    plan = pca.plan(60, ("a", "b"), norm_bound=1000)
    share = pca.share(covariance_sum(rng.normal(size=(500, 60))), plan, ("a", "b"), masks_for(2)[0],
                      POLICY.source("uniform"))
    assert stats.kstest(share / plan.modulus, "uniform").pvalue > 1e-4  # fails once in 10⁴ runs at most


def test_bad_inputs_are_refused():
    pca, counts = SecureAnalyzeGauss(1.0, DELTA), SkellamCounts(1.0, DELTA)
    with pytest.raises(ValueError, match="cost more than its charge"):
        pca.plan(4, ("a", "b", "c"), norm_bound=1e17)  # the ring caps the scale below the charged one
    with pytest.raises(ValueError, match="dimension"):
        pca.plan(0, ("a", "b"), norm_bound=10)
    with pytest.raises(ValueError, match="epsilon"):
        SkellamCounts(0.0, DELTA)
    with pytest.raises(ValueError, match="delta"):
        SecureAnalyzeGauss(1.0, 1.0)
    plan = counts.plan(3, ("a", "b"), norm_bound=10)
    masks = masks_for(2)
    with pytest.raises(ValueError, match="non-negative"):
        counts.share(np.array([1, -1, 0]), plan, ("a", "b"), masks[0], POLICY.source("bad"))
    with pytest.raises(ValueError, match="integer"):
        counts.share(np.array([1.0, 0.0, 0.0]), plan, ("a", "b"), masks[0], POLICY.source("bad"))
    share = counts.share(np.array([1, 0, 0]), plan, ("a", "b"), masks[0], POLICY.source("bad"))
    with pytest.raises(ValueError, match="one share from each"):
        counts.release([share], plan)  # a missing share: the total would be noise, so nothing is released
    with pytest.raises(ValueError, match="upper triangle"):
        symmetric_from_upper(np.zeros(4))


def test_a_key_request_left_over_from_an_abandoned_release_never_replaces_the_fresh_key():
    """A hung owner that comes back runs the old release's key request late, on another thread,
    after the new release's: the new release still takes the pair its parties hold, once."""
    from conclave.privacy.secure_release import ReleaseKeys

    party = ReleaseKeys()
    fresh = party.mask_key(1)
    party.mask_key(1)  # the late request of the abandoned release
    others = MaskKeys(0).public_bytes
    assert party._take_mask_keys((others, fresh)).public_bytes == fresh
    with pytest.raises(RuntimeError, match="no fresh mask key"):
        party._take_mask_keys((others, fresh))  # handed out once; the stale pair is gone too
