"""Where DP noise comes from: OS entropy by default (two sources never agree), a loudly named
seed only on request (and then unsound), and released numbers drawn by exact samplers whose
output distributions pass χ² tests against the discrete Laplace and the Gaussian."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from conclave.privacy.noise import SECURE, NoisePolicy

DRAWS = 20_000


def test_default_sources_are_independent_and_sound():
    assert SECURE.sound and SECURE.unsound_reason is None
    a, b = SECURE.source("aggregator"), SECURE.source("aggregator")
    assert a.secure and b.secure
    assert not np.array_equal(a.rng.normal(size=8), b.rng.normal(size=8))  # same stream name, fresh entropy
    assert a.seed() != b.seed()


def test_an_insecure_seed_replays_and_is_marked_unsound():
    policy = NoisePolicy(insecure_seed=3)
    assert not policy.sound and "insecure_noise_seed=3" in policy.unsound_reason
    first, again, other = policy.source("dp-pca"), policy.source("dp-pca"), policy.source("counts")
    assert np.array_equal(first.rng.normal(size=8), again.rng.normal(size=8))
    assert not np.array_equal(policy.source("dp-pca").rng.normal(size=8), other.rng.normal(size=8))
    assert first.seed() == again.seed()


def discrete_laplace_pmf(z: np.ndarray, scale: float) -> np.ndarray:
    t = math.exp(-1 / scale)
    return (1 - t) / (1 + t) * t ** np.abs(z)


@pytest.mark.parametrize("policy", [SECURE, NoisePolicy(insecure_seed=1)], ids=["opendp", "seeded"])
def test_laplace_counts_follow_the_discrete_laplace(policy):
    scale = 1 / 0.7
    noisy = policy.source("counts").laplace_counts(np.full(DRAWS, 5, dtype=np.int64), scale)
    assert noisy.dtype == np.int64
    z = noisy - 5
    support = np.arange(-6, 7)
    observed = np.array([(z < -6).sum(), *[(z == v).sum() for v in support], (z > 6).sum()])
    pmf = discrete_laplace_pmf(support, scale)
    tail = (1 - pmf.sum()) / 2
    expected = DRAWS * np.array([tail, *pmf, tail])
    assert stats.chisquare(observed, expected).pvalue > 1e-6


def test_gaussian_release_follows_the_normal_and_keeps_its_shape():
    source = SECURE.source("dp-pca")
    values = np.zeros((DRAWS // 100, 100))
    noisy = source.gaussian(values, 3.0)
    assert noisy.shape == values.shape and noisy.dtype == np.float64
    z = noisy.ravel() / 3.0
    edges = stats.norm.ppf(np.linspace(0, 1, 21))  # 20 equiprobable bins
    observed = np.histogram(z, bins=edges)[0]
    assert stats.chisquare(observed, np.full(20, DRAWS / 20)).pvalue > 1e-6


def test_released_values_are_checked():
    source = SECURE.source("x")
    with pytest.raises(ValueError, match="finite"):
        source.gaussian(np.array([np.nan]), 1.0)
    with pytest.raises(ValueError, match="integer"):
        source.laplace_counts(np.array([1.5]), 1.0)
    with pytest.raises(ValueError, match="scale"):
        source.laplace_counts(np.array([1]), 0.0)
