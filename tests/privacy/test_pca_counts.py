"""Analyze Gauss DP-PCA and discrete-Laplace noisy counts: calibration, noise shape, separability."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp, pure_dp_rdp
from conclave.privacy.counts import LaplaceCounts
from conclave.privacy.noise import SECURE, NoisePolicy
from conclave.privacy.pca import AnalyzeGauss, covariance_sum, gaussian_noise_for_epsilon, normalise_rows


def analytic_gaussian_delta(z: float, epsilon: float) -> float:
    """Exact δ(ε) of the Gaussian mechanism, sensitivity 1, σ = z (Balle & Wang 2018, Thm 8)."""
    return stats.norm.cdf(1 / (2 * z) - epsilon * z) - np.exp(epsilon) * stats.norm.cdf(-1 / (2 * z) - epsilon * z)


@pytest.mark.parametrize("epsilon,delta", [(0.3, 1e-5), (1.0, 1e-5), (2.0, 1e-6)])
def test_calibrated_noise_is_sound_and_not_wasteful(epsilon, delta):
    z = gaussian_noise_for_epsilon(epsilon, delta)
    mechanism = AnalyzeGauss(epsilon, delta)
    assert mechanism.noise_multiplier == pytest.approx(z)
    charge = mechanism.charge()
    eps, _ = epsilon_from_rdp(charge.orders, charge.rdp, delta)
    assert eps <= epsilon and eps == pytest.approx(epsilon, rel=1e-3)
    # Independent check with the exact Gaussian privacy curve: the RDP-calibrated σ really
    # gives (ε, δ)-DP, and is within 25% of the smallest σ that does.
    assert analytic_gaussian_delta(z, epsilon) <= delta
    low, high = 0.05, z
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if analytic_gaussian_delta(mid, epsilon) > delta else (low, mid)
    assert z <= 1.25 * high


def test_covariance_sum_is_separable_over_shards_and_rows_are_unit():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 7)) * 5
    shards = np.array_split(x, 3)
    np.testing.assert_allclose(sum(covariance_sum(s) for s in shards), covariance_sum(x), atol=1e-9)
    assert np.allclose(np.linalg.norm(normalise_rows(x), axis=1), 1.0)
    # trace = number of (non-zero) rows: each row contributes ‖x‖² = 1
    assert np.trace(covariance_sum(x)) == pytest.approx(300)


def test_noise_is_symmetric_with_the_calibrated_scale():
    mechanism = AnalyzeGauss(epsilon=1.0, delta=1e-5)
    noise = SECURE.source("dp-pca")
    draws = np.stack([mechanism.noisy_covariance(np.zeros((6, 6)), noise) for _ in range(2000)])
    np.testing.assert_array_equal(draws, np.swapaxes(draws, 1, 2))
    upper = draws[:, *np.triu_indices(6)]
    assert upper.std() == pytest.approx(mechanism.noise_multiplier, rel=0.03)
    assert abs(np.corrcoef(upper[:, 0], upper[:, 1])[0, 1]) < 0.1  # independent entries


def test_release_finds_the_dominant_subspace():
    rng = np.random.default_rng(2)
    basis = np.linalg.qr(rng.normal(size=(10, 2)))[0]
    x = rng.normal(size=(5000, 2)) * [3.0, 2.0] @ basis.T + 0.05 * rng.normal(size=(5000, 10))
    projection = AnalyzeGauss(epsilon=1.0, delta=1e-5).release(covariance_sum(x), 2, SECURE.source("dp-pca"))
    assert projection.shape == (10, 2)
    # principal angles between the released and the true subspace are small
    cosines = np.linalg.svd(projection.T @ basis, compute_uv=False)
    assert cosines.min() > 0.99


def test_laplace_counts_have_scale_one_over_epsilon():
    mechanism = LaplaceCounts(epsilon=0.5)
    counts = np.arange(20000) % 7
    released = mechanism.release(counts, SECURE.source("counts"))
    noise = released - counts
    assert mechanism.scale == 2.0 and released.dtype == np.int64  # integers: nothing hides in low bits
    t = np.exp(-1 / 2.0)
    assert np.mean(np.abs(noise)) == pytest.approx(2 * t / (1 - t**2), rel=0.03)  # E|Z| of the discrete Laplace
    assert np.mean(np.abs(noise)) > 1.1 * 2 * np.exp(-1 / 1.5) / (1 - np.exp(-2 / 1.5))  # not a larger ε's
    np.testing.assert_allclose(mechanism.charge().rdp, pure_dp_rdp(DEFAULT_ORDERS, 0.5))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="epsilon"):
        LaplaceCounts(epsilon=0)
    with pytest.raises(ValueError, match="epsilon"):
        AnalyzeGauss(epsilon=-1, delta=1e-5)
    with pytest.raises(ValueError, match="delta"):
        AnalyzeGauss(epsilon=1, delta=0)
    noise = NoisePolicy(insecure_seed=0).source("test")
    with pytest.raises(ValueError, match="non-negative"):
        LaplaceCounts(1.0).release(np.array([-1]), noise)
    with pytest.raises(ValueError, match="integer"):
        LaplaceCounts(1.0).release(np.array([1.5]), noise)
    with pytest.raises(ValueError, match="components"):
        AnalyzeGauss(1.0, 1e-5).release(np.eye(3), 4, noise)
