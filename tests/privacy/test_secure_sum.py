"""Secure sum: masks cancel exactly, a share says nothing about its vector, the ring never
overflows an int64 all-reduce, quantization keeps Δ₂ = γc + √d, and the Skellam shares add up
to the variance every owner must face. Seeds here are for the tests only."""
from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from scipy import stats

from conclave.privacy.noise import NoisePolicy
from conclave.privacy.secure_sum import (
    MaskKeys,
    SecureSumPlan,
    bernstein_tail,
    bernstein_threshold,
    decode,
    decode_integers,
    masked_share,
    project,
    quantize,
    secure_sum,
    skellam_noise,
)


def make_plan(**overrides) -> SecureSumPlan:
    settings = dict(dimension=1000, parties=3, owners=3, norm_bound=10.0, sensitivity=1.0, noise_multiplier=1.0)
    return SecureSumPlan(**(settings | overrides))


def fixed_keys(parties: int, offset: int = 0) -> list[MaskKeys]:
    """Key pairs from fixed private bytes, so the statistical tests are deterministic."""
    return [MaskKeys(rank, X25519PrivateKey.from_private_bytes(bytes([rank + 1 + offset]) * 32))
            for rank in range(parties)]


def session_masks(keys: list[MaskKeys], session: str = "test"):
    publics = [key.public_bytes for key in keys]
    return [key.pairwise_masks(publics, session) for key in keys]


@pytest.mark.parametrize("parties", [2, 3, 4, 5])
@pytest.mark.parametrize("dimension", [1, 1000, 100_000])
def test_masks_cancel_and_the_total_decodes_exactly(parties, dimension):
    plan = make_plan(dimension=dimension, parties=parties, owners=parties)
    rng = np.random.default_rng(parties * dimension)
    masks = session_masks([MaskKeys(rank) for rank in range(parties)])
    for round_number in (0, 1, 7):
        vectors = [rng.normal(0, 3, dimension) for _ in range(parties)]
        quantized = [quantize(v, plan) for v in vectors]
        noise = [skellam_noise(dimension, variance, rng) for variance in plan.party_variances(range(parties))]
        shares = [masked_share(q, n, m, plan, round_number) for q, n, m in zip(quantized, noise, masks)]
        assert all(s.dtype == np.int64 and s.min() >= 0 and s.max() < plan.modulus for s in shares)
        total = np.sum(shares, axis=0)  # what an int64 all-reduce computes: W values below m < 2^63 / W
        assert np.array_equal(decode_integers(total, plan), np.sum(quantized, axis=0) + np.sum(noise, axis=0))
        assert np.array_equal(decode(total, plan), (np.sum(quantized, axis=0) + np.sum(noise, axis=0)) / plan.scale)


def test_pair_keys_agree_per_pair_and_masks_change_every_round():
    keys = [MaskKeys(rank) for rank in range(4)]
    masks = session_masks(keys)
    pair_keys = {}
    for i in range(4):
        for j in range(4):
            if i != j:
                assert masks[i].pair_keys[j] == masks[j].pair_keys[i]  # both sides derive the same key
                pair_keys[frozenset((i, j))] = masks[i].pair_keys[j]
    assert len(set(pair_keys.values())) == 6  # every pair its own key
    other_session = session_masks(keys, session="another run")
    assert all(other_session[0].pair_keys[j] != masks[0].pair_keys[j] for j in (1, 2, 3))

    plan = make_plan(dimension=4096, parties=4, owners=4)
    first, second = masks[0].mask(0, plan), masks[0].mask(1, plan)
    assert not np.array_equal(first, second)
    assert np.mean(first == second) < 0.01
    with pytest.raises(ValueError, match="masks are never reused"):
        masks[0].mask(1, plan)
    with pytest.raises(ValueError, match="masks are never reused"):
        masks[0].mask(0, plan)


def chacha20_stream(key: bytes, round_number: int, dimension: int) -> np.ndarray:
    """The pair's stream as the module documents it: ChaCha20, block counter 0, nonce = round."""
    nonce = bytes(4) + round_number.to_bytes(8, "little") + bytes(4)
    encryptor = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(8 * dimension)), dtype="<u8")


def uniformity_p_values(shares: np.ndarray, modulus_bits: int) -> list[float]:
    """χ² p-values of the low and the high byte of shares against the uniform distribution."""
    low = shares & 0xFF
    high = shares >> (modulus_bits - 8)
    return [stats.chisquare(np.bincount(byte, minlength=256)).pvalue for byte in (low, high)]


def test_a_share_is_uniform_whatever_the_vector_and_its_peers_cannot_unmask_it():
    dimension, rounds = 20_000, 5
    plan = make_plan(dimension=dimension, norm_bound=100.0)
    peak = np.zeros(dimension)
    peak[::2] = plan.norm_bound / math.sqrt(dimension / 2)  # on the sphere of radius R
    inputs = {"zeros": np.zeros(dimension), "extreme": peak}
    shares_by_input, attacker_views = {}, {}
    for offset, (name, vector) in enumerate(inputs.items()):
        keys = fixed_keys(3, offset=10 * offset)
        masks = session_masks(keys)
        rng = np.random.default_rng(offset)
        shares, views = [], []
        for round_number in range(rounds):
            noise = skellam_noise(dimension, plan.party_variances(range(3))[0], rng)
            share = masked_share(quantize(vector, plan), noise, masks[0], plan, round_number)
            shares.append(share)
            # Party 2 (colluding with whoever sums) knows its own pair key with party 0 and strips
            # that stream; the stream of pair (0, 1) is what it cannot remove.
            stripped = share.view(np.uint64) - chacha20_stream(masks[2].pair_keys[0], round_number, dimension)
            views.append((stripped & np.uint64(plan.modulus - 1)).astype(np.int64))
        shares_by_input[name] = np.concatenate(shares)
        attacker_views[name] = np.concatenate(views)
        for sample in (shares_by_input[name], attacker_views[name]):
            assert min(uniformity_p_values(sample, plan.modulus_bits)) > 1e-4
            assert stats.kstest(sample / plan.modulus, "uniform").pvalue > 1e-4
    # The shares of a zero vector and of an extreme one are indistinguishable.
    two_sample = stats.ks_2samp(shares_by_input["zeros"], shares_by_input["extreme"])
    assert two_sample.pvalue > 1e-4

    # Without party 0's or party 1's private key, the pair key is out of reach: the attacker's own
    # exchanges with their public keys, put through the same derivation, give other keys.
    keys = fixed_keys(3)
    masks = session_masks(keys)
    attacker = X25519PrivateKey.from_private_bytes(bytes([3]) * 32)
    for public in (keys[0].public_bytes, keys[1].public_bytes):
        secret = attacker.exchange(X25519PublicKey.from_public_bytes(public))
        guess = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"").derive(secret)
        assert guess != masks[0].pair_keys[1]
    assert masks[2].pair_keys[0] != masks[0].pair_keys[1] != masks[2].pair_keys[1]


def test_the_ring_never_overflows_an_int64_all_reduce():
    for parties in range(1, 70):
        plan = make_plan(parties=parties, owners=1)
        assert parties * plan.modulus < 2**63
        assert plan.modulus <= 2**62
        assert 2 * parties * plan.modulus >= 2**63 or plan.modulus == 2**62  # the largest such ring
        assert plan.max_abs_total <= plan.modulus // 2 - 1


def test_a_vector_too_large_for_the_ring_is_refused_in_one_line():
    with pytest.raises(ValueError) as refused:
        make_plan(dimension=1_000_000, parties=8, norm_bound=2.0**58)
    message = str(refused.value)
    assert "\n" not in message
    # W = 8: m = 2^59 (8·2^59 < 2^63); 8·(2^58 + 1) + t > 2^61 must lie below m/2, so m ≥ 2^63.
    assert "d=1000000" in message and "W=8" in message and "the ring has 59" in message
    assert "needs 63 bits" in message


def test_extreme_totals_round_trip():
    plan = make_plan(parties=4, owners=2)
    half = plan.modulus // 2
    extremes = np.array([-half, -half + 1, -1, 0, 1, half - 1, -plan.max_abs_total, plan.max_abs_total],
                        dtype=np.int64)
    rng = np.random.default_rng(0)
    shares = [rng.integers(0, plan.modulus, extremes.size, dtype=np.int64) for _ in range(plan.parties - 1)]
    shares.append((extremes - np.sum(shares, axis=0)) % plan.modulus)  # the last share closes the sum
    assert np.array_equal(decode_integers(np.sum(shares, axis=0), plan), extremes)

    # The largest quantized values and noise the plan allows, through real masked shares.
    dimension = plan.dimension
    top = math.ceil(plan.scale * plan.norm_bound) + 1
    values = np.zeros(dimension, dtype=np.int64)
    values[:2] = (top, -top)
    noise = np.zeros(dimension, dtype=np.int64)
    noise[:2] = (plan.wrap_bound, -plan.wrap_bound)
    masks = session_masks([MaskKeys(rank) for rank in range(plan.parties)])
    total = sum(masked_share(values, noise if rank == 0 else np.zeros_like(noise), masks[rank], plan, 0)
                for rank in range(plan.parties))
    decoded = decode_integers(total, plan)
    assert decoded[0] == plan.max_abs_total and decoded[1] == -plan.max_abs_total


def test_scale_is_the_smallest_meeting_the_rounding_target_unless_the_ring_caps_it(caplog):
    # √d / (0.05 · c) = 2000 → γ = 2048 (1024 is too small).
    plan = make_plan(dimension=10_000)
    assert plan.scale == 2048
    assert plan.l2_sensitivity == 2048 + 100
    assert plan.l1_sensitivity == pytest.approx(100 * (2048 + 100))
    assert plan.noise_variance == pytest.approx((2048 + 100) ** 2)
    # W = 4, m = 2^60: 4·(2^54·γ + 1) + t ≤ 2^59 − 1 holds for γ = 4, not for γ = 8 (target: 32).
    with caplog.at_level(logging.WARNING, logger="conclave.privacy.secure_sum"):
        capped = make_plan(dimension=1, parties=4, owners=4, norm_bound=2.0**54)
    assert capped.modulus_bits == 60 and capped.scale == 4
    assert "caps the quantization scale" in caplog.text


def test_integer_inputs_keep_their_sensitivity():
    plan = make_plan(dimension=400, integer_inputs=True, norm_bound=1000.0)
    assert plan.scale == 1 and plan.l2_sensitivity == 1.0 and plan.l1_sensitivity == 1.0
    counts = np.arange(400, dtype=np.int32)
    assert np.array_equal(quantize(counts, plan), counts)
    with pytest.raises(ValueError, match="integer vectors"):
        quantize(counts.astype(float), plan)
    wide = make_plan(dimension=400, integer_inputs=True, sensitivity=3.0)
    assert wide.l1_sensitivity == 9.0  # min(√400 · 3, 3²): an integer vector has ‖x‖₁ ≤ ‖x‖₂²


def test_quantization_moves_a_pair_by_at_most_gamma_times_their_distance_plus_root_d():
    plan = make_plan(dimension=1000, norm_bound=5.0)
    rng = np.random.default_rng(3)
    root_d = math.sqrt(plan.dimension)
    for scale in (0.01, 0.1, 1.0, 10.0):  # inside and far outside the R-ball
        for _ in range(50):
            a = rng.normal(0, scale, plan.dimension)
            b = a + rng.normal(0, scale * rng.uniform(0, 1), plan.dimension)
            distance = np.linalg.norm(a - b)
            assert np.linalg.norm(project(a, plan.norm_bound) - project(b, plan.norm_bound)) <= distance + 1e-12
            moved = np.linalg.norm(quantize(a, plan) - quantize(b, plan))
            assert moved <= plan.scale * distance + root_d + 1e-9
            assert np.abs(quantize(a, plan)).max() <= plan.scale * plan.norm_bound + 1
    # Rounding alone can move every coordinate by one: the √d term is needed.
    a = np.full(plan.dimension, (0.5 - 1e-9) / plan.scale)  # rounds to 0 …
    b = np.full(plan.dimension, (0.5 + 1e-9) / plan.scale)  # … and to 1, 2·10^-9/γ away
    assert np.linalg.norm(quantize(a, plan) - quantize(b, plan)) == pytest.approx(root_d)


def test_skellam_shares_sum_to_the_planned_variances():
    dimension = 200_000
    plan = make_plan(dimension=dimension, parties=4, owners=3, noise_multiplier=0.01)
    owner_of = ["a", "a", "b", "c"]
    variances = plan.party_variances(owner_of)
    rng = NoisePolicy(insecure_seed=5).source("test")  # test only: replayable
    shares = [skellam_noise(dimension, variance, rng) for variance in variances]
    assert all(share.dtype == np.int64 for share in shares)
    total = np.sum(shares, axis=0)
    assert total.var() == pytest.approx(plan.outsider_variance, rel=0.03)
    assert abs(total.mean()) < 5 * math.sqrt(plan.outsider_variance / dimension)
    for owner in "abc":
        unknown = sum(share for share, o in zip(shares, owner_of) if o != owner)
        assert unknown.var() == pytest.approx(plan.noise_variance, rel=0.03)


def test_large_skellam_variances_are_drawn_as_sums_of_poissons():
    rng = np.random.default_rng(11)
    noise = skellam_noise(50_000, 2.0**33, rng)  # λ = 2^32: four draws of 2^30 per sign
    assert noise.dtype == np.int64
    assert noise.var() == pytest.approx(2.0**33, rel=0.03)
    with pytest.raises(ValueError, match="Poisson draws"):
        skellam_noise(10, 1e20, rng)


def test_small_skellam_matches_the_skellam_pmf():
    rng = np.random.default_rng(12)
    noise = skellam_noise(100_000, 4.0, rng)  # Poisson(2) − Poisson(2)
    support = np.arange(-8, 9)
    observed = np.array([np.sum(noise == k) for k in support] + [np.sum(np.abs(noise) > 8)])
    pmf = stats.skellam.pmf(support, 2.0, 2.0)
    expected = np.append(pmf, 1 - pmf.sum()) * noise.size
    assert stats.chisquare(observed, expected).pvalue > 1e-4


@pytest.mark.parametrize("owner_of", [[0], [0, 0, 0], [0, 1], [0, 1, 1, 1], [0, 1, 2, 2, 3], list(range(7)),
                                      [0, 0, 1, 1, 2, 2, 2]])
def test_every_owner_faces_at_least_the_target_variance(owner_of):
    owners = len(set(owner_of))
    plan = make_plan(parties=len(owner_of), owners=owners, noise_multiplier=1.3)
    variances = plan.party_variances(owner_of)
    assert sum(variances) == pytest.approx(plan.outsider_variance)
    if owners == 1:
        assert sum(variances) >= plan.noise_variance
    for owner in set(owner_of):
        unknown = sum(v for v, o in zip(variances, owner_of) if o != owner)
        assert owners == 1 or unknown >= plan.noise_variance
    assert plan.noise_variance == pytest.approx((1.3 * plan.l2_sensitivity) ** 2)
    expected_outsider = plan.noise_variance * owners / (owners - 1) if owners > 1 else plan.noise_variance
    assert plan.outsider_variance == pytest.approx(expected_outsider)


def test_bernstein_bounds_the_exact_skellam_tail():
    for variance in (2.0, 50.0, 1e4, 1e6):
        lam = variance / 2
        for sds in (1, 3, 6, 10):
            t = math.ceil(sds * math.sqrt(variance))
            exact = 2 * stats.skellam.sf(t - 1, lam, lam)  # P(|X| ≥ t)
            assert exact <= bernstein_tail(variance, t)
    # Worked by hand (mpmath, 40 digits): Var = 10^6, failure 2^-40 / 10^6 → L = 42.2345…,
    # t = L/3 + sqrt(L²/9 + 2·L·Var) = 9204.7957, rounded up, plus one for float error.
    assert bernstein_threshold(1e6, 2.0**-40 / 1e6) == 9206
    assert bernstein_tail(1e6, 9205) <= 2.0**-40 / 1e6


def test_reference_secure_sum_is_close_to_the_true_sum():
    plan = make_plan(dimension=5000, parties=3, owners=2, norm_bound=50.0)
    rng = np.random.default_rng(4)
    vectors = [rng.normal(0, 0.3, plan.dimension) for _ in range(plan.parties)]
    masks = session_masks([MaskKeys(rank) for rank in range(plan.parties)])
    rngs = [NoisePolicy().source(f"party-{rank}") for rank in range(plan.parties)]
    released = secure_sum(vectors, plan, rngs, masks, 0, owner_of=["x", "x", "y"])
    error = released - np.sum(vectors, axis=0)
    sd = math.sqrt(plan.outsider_variance) / plan.scale
    assert error.std() == pytest.approx(sd, rel=0.1)


def test_bad_inputs_get_one_line_errors():
    with pytest.raises(ValueError, match="owners .* cannot outnumber parties"):
        make_plan(parties=2, owners=3)
    with pytest.raises(ValueError, match="dimension must be a positive integer"):
        make_plan(dimension=0)
    with pytest.raises(ValueError, match="noise_multiplier must be a positive finite number"):
        make_plan(noise_multiplier=float("nan"))
    with pytest.raises(ValueError, match="wrap_probability"):
        make_plan(wrap_probability=0.0)
    plan = make_plan()
    with pytest.raises(ValueError, match="shape"):
        quantize(np.zeros(3), plan)
    with pytest.raises(ValueError, match="finite"):
        quantize(np.full(plan.dimension, np.inf), plan)
    with pytest.raises(ValueError, match="owners"):
        plan.party_variances([0, 0, 0])
    keys = [MaskKeys(rank) for rank in range(3)]
    publics = [key.public_bytes for key in keys]
    with pytest.raises(ValueError, match="not this party's public key"):
        keys[0].pairwise_masks(publics[::-1], "s")
    with pytest.raises(ValueError, match="same public key"):
        keys[0].pairwise_masks([publics[0], publics[1], publics[1]], "s")
    masks = keys[0].pairwise_masks(publics, "s")
    with pytest.raises(ValueError, match="for 3 parties"):
        masks.mask(0, make_plan(parties=4, owners=4))
    with pytest.raises(ValueError, match="integer vector"):
        masked_share(np.zeros(plan.dimension), np.zeros(plan.dimension, dtype=np.int64), masks, plan, 0)
