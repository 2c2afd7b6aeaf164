"""Each vote mechanism's output distribution matches its formula (fixed-seed χ² tests), and
its charge is the data-independent bound it documents."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import integrate, stats

from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, pure_dp_rdp
from conclave.privacy.mechanisms import (
    ABSTAIN,
    MECHANISMS,
    NZC,
    ConfidentGNMax,
    GNMax,
    LNMax,
    Stability,
    build_mechanism,
)

HISTOGRAM = np.array([10, 8, 5])
DRAWS = 20_000


def gnmax_probabilities(counts: np.ndarray, sigma: float) -> np.ndarray:
    """P[argmax_j (n_j + N(0, σ²)) = j] by numerical integration over the winner's noisy count."""
    lo, hi = counts.min() - 12 * sigma, counts.max() + 12 * sigma

    def density(x: float, j: int) -> float:
        others = np.delete(counts, j)
        return stats.norm.pdf(x, counts[j], sigma) * np.prod(stats.norm.cdf(x, others, sigma))

    return np.array([integrate.quad(density, lo, hi, args=(j,), points=list(counts), limit=200)[0] for j in range(len(counts))])


def lnmax_probabilities(counts: np.ndarray, scale: float) -> np.ndarray:
    """P[argmax_j (n_j + Lap(b)) = j] by numerical integration (breakpoints at the counts)."""
    lo, hi = counts.min() - 50 * scale, counts.max() + 50 * scale

    def density(x: float, j: int) -> float:
        others = np.delete(counts, j)
        return stats.laplace.pdf(x, counts[j], scale) * np.prod(stats.laplace.cdf(x, others, scale))

    return np.array([integrate.quad(density, lo, hi, args=(j,), points=list(counts), limit=200)[0] for j in range(len(counts))])


def observed(labels: np.ndarray, outcomes: list[int]) -> np.ndarray:
    assert set(np.unique(labels)) <= set(outcomes)
    return np.array([(labels == o).sum() for o in outcomes])


def chi2_pvalue(counts: np.ndarray, probabilities: np.ndarray) -> float:
    assert probabilities.sum() == pytest.approx(1.0, abs=1e-6)
    return stats.chisquare(counts, counts.sum() * probabilities / probabilities.sum()).pvalue


def batch(histogram: np.ndarray, draws: int = DRAWS) -> np.ndarray:
    return np.tile(histogram, (draws, 1))


def test_gnmax_matches_its_distribution():
    labels = GNMax(sigma=4.0)(batch(HISTOGRAM), np.random.default_rng(1)).labels
    counts = observed(labels, [0, 1, 2])
    assert chi2_pvalue(counts, gnmax_probabilities(HISTOGRAM, 4.0)) > 1e-3
    # the test has power: the same draws reject the formula at a different σ
    assert chi2_pvalue(counts, gnmax_probabilities(HISTOGRAM, 6.0)) < 1e-6


def test_lnmax_matches_its_distribution():
    labels = LNMax(laplace_scale=3.0)(batch(HISTOGRAM), np.random.default_rng(2)).labels
    counts = observed(labels, [0, 1, 2])
    assert chi2_pvalue(counts, lnmax_probabilities(HISTOGRAM, 3.0)) > 1e-3
    assert chi2_pvalue(counts, lnmax_probabilities(HISTOGRAM, 4.5)) < 1e-6
    assert chi2_pvalue(counts, gnmax_probabilities(HISTOGRAM, 3.0 * np.sqrt(2))) < 1e-6  # same variance, wrong law


def test_confident_gnmax_abstains_at_the_gaussian_tail_rate():
    sigma1, threshold, sigma2 = 3.0, 11.0, 4.0
    result = ConfidentGNMax(sigma1=sigma1, threshold=threshold, sigma2=sigma2)(batch(HISTOGRAM), np.random.default_rng(3))
    p_abstain = stats.norm.cdf((threshold - HISTOGRAM.max()) / sigma1)  # P[max + N(0, σ1²) < T]
    expected = np.concatenate([[p_abstain], (1 - p_abstain) * gnmax_probabilities(HISTOGRAM, sigma2)])
    counts = observed(result.labels, [ABSTAIN, 0, 1, 2])
    assert chi2_pvalue(counts, expected) > 1e-3
    wrong = np.concatenate([[0.5], 0.5 * gnmax_probabilities(HISTOGRAM, sigma2)])  # rate ≈ 0.63, not 0.5
    assert chi2_pvalue(counts, wrong) < 1e-6
    # charge: threshold on every query, GNMax only on the answered ones
    answered = int((result.labels != ABSTAIN).sum())
    expected_rdp = DRAWS * DEFAULT_ORDERS / (2 * sigma1**2) + answered * DEFAULT_ORDERS / sigma2**2
    np.testing.assert_allclose(result.charge.rdp, expected_rdp, rtol=1e-12)


def test_nzc_is_lnmax_on_the_shifted_histogram():
    # With a moderate constant, NZC = LNMax on n + c·e_{j*}; checks the mechanism as described.
    constant, scale = 4.0, 3.0
    labels = NZC(constant=constant, laplace_scale=scale)(batch(HISTOGRAM), np.random.default_rng(4)).labels
    shifted = HISTOGRAM + constant * (np.arange(3) == 0)
    counts = observed(labels, [0, 1, 2])
    assert chi2_pvalue(counts, lnmax_probabilities(shifted, scale)) > 1e-3
    assert chi2_pvalue(counts, lnmax_probabilities(HISTOGRAM, scale)) < 1e-6


@pytest.mark.parametrize("noise", [{"laplace_scale": 1e10}, {"sigma": 1e10}])
def test_nzc_equals_plurality_at_the_papers_constant(noise):
    # Sun et al. 2019, Table 1: c = 1e100 with noise scale 1e10.
    votes = np.random.default_rng(5).multinomial(250, [0.4, 0.3, 0.1, 0.1, 0.1], size=5000)
    labels = NZC(constant=1e100, **noise)(votes, np.random.default_rng(6)).labels
    assert np.array_equal(labels, np.argmax(votes, axis=1))


def test_charges_are_the_documented_data_independent_bounds():
    votes = batch(HISTOGRAM, 7)
    lnmax = LNMax(laplace_scale=20.0)(votes, np.random.default_rng(0))
    np.testing.assert_allclose(lnmax.charge.rdp, 7 * pure_dp_rdp(DEFAULT_ORDERS, 0.1))
    gnmax = GNMax(sigma=40.0)(votes, np.random.default_rng(0))
    np.testing.assert_allclose(gnmax.charge.rdp, 7 * DEFAULT_ORDERS / 1600)
    for mechanism in (LNMax(20.0), GNMax(40.0), ConfidentGNMax(150.0, 200.0, 40.0)):
        result = mechanism(votes, np.random.default_rng(0))
        worst = mechanism.worst_case_charge(7)
        assert np.all(result.charge.rdp <= worst.rdp + 1e-15)
        assert result.labels.dtype == np.int64 and result.labels.shape == (7,)
    confident = ConfidentGNMax(150.0, 200.0, 40.0)
    np.testing.assert_allclose(
        confident.worst_case_charge(7).rdp, 7 * DEFAULT_ORDERS / (2 * 150.0**2) + 7 * DEFAULT_ORDERS / 40.0**2
    )


@pytest.mark.parametrize(
    "votes, message",
    [
        (np.array([1, 2, 3]), "2-D"),
        (np.array([[1.0, 2.0]]), "integers"),
        (np.array([[1, -2]]), "non-negative"),
        (np.zeros((2, 0), dtype=int), "class"),
    ],
)
def test_bad_votes_are_rejected_by_every_mechanism(votes, message):
    for mechanism in (LNMax(1.0), GNMax(1.0), ConfidentGNMax(1.0, 1.0, 1.0), NZC(1.0, sigma=1.0), Stability(1.0, 1e-5, 5)):
        with pytest.raises(ValueError, match=message):
            mechanism(votes, np.random.default_rng(0))


def test_build_mechanism_uses_the_cli_names():
    assert set(MECHANISMS) == {"lnmax", "gnmax", "confident-gnmax", "nzc", "stability", "private-knn",
                               "public-clusters"}
    assert build_mechanism("lnmax", laplace_scale=20.0) == LNMax(20.0)
    assert build_mechanism("gnmax", sigma=40.0, laplace_scale=None) == GNMax(40.0)
    # --sigma is σ2 for confident-gnmax
    assert build_mechanism("confident-gnmax", sigma1=150.0, threshold=200.0, sigma=40.0) == ConfidentGNMax(150.0, 200.0, 40.0)
    assert build_mechanism("nzc", constant=1e100, laplace_scale=1e10) == NZC(1e100, laplace_scale=1e10)
    stability = build_mechanism("stability", epsilon=2.0, delta=1e-5, max_unstable=10)
    assert stability.run_charge(1, 1).extra_delta == 1e-5
    for name in MECHANISMS:
        mechanism = build_mechanism(name, **_example_params(name))
        assert mechanism.name == name
        description = mechanism.describe()  # each mechanism describes itself for reports
        assert description.name == name and description.analysis and description.releases
        assert description.bounded == (name != "nzc")
        assert set(mechanism.help) <= set(description.parameters) | {"max_queries", "laplace_scale", "sigma"}
    with pytest.raises(ValueError, match="unknown mechanism"):
        build_mechanism("gnmax2", sigma=1.0)
    with pytest.raises(ValueError, match="does not take threshold"):
        build_mechanism("gnmax", sigma=1.0, threshold=3.0)
    with pytest.raises(ValueError, match="missing parameter.*threshold"):
        build_mechanism("confident-gnmax", sigma1=1.0, sigma=1.0)
    with pytest.raises(ValueError, match="sigma must be > 0"):
        build_mechanism("gnmax", sigma=-1.0)
    with pytest.raises(ValueError, match="exactly one"):
        build_mechanism("nzc", constant=5.0)


def _example_params(name: str) -> dict:
    return {
        "lnmax": {"laplace_scale": 20.0},
        "gnmax": {"sigma": 40.0},
        "confident-gnmax": {"sigma1": 150.0, "threshold": 200.0, "sigma": 40.0},
        "nzc": {"constant": 1e100, "sigma": 1e10},
        "stability": {"epsilon": 1.0, "delta": 1e-5, "max_unstable": 10, "max_queries": 100},
        "private-knn": {"sigma1": 75.0, "threshold": 180.0, "sigma2": 25.0, "sample_rate": 0.05},
        "public-clusters": {"sigma": 20.0, "m": 3, "purity": 0.8},
    }[name]


def test_vote_mechanism_charges_hold_for_one_vote_and_restate_for_records():
    # Records that vote themselves (kNN, public clusters) are charged at record level already
    # (tests/privacy/test_private_knn.py, test_public_clusters.py).
    for name in set(MECHANISMS) - {"private-knn", "public-clusters"}:
        charge = build_mechanism(name, **_example_params(name)).worst_case_charge(3)
        assert charge.neighbouring == "one-vote"
        with pytest.raises(ValueError, match="must say why"):
            charge.for_records("add-remove", "")
        assert charge.for_records("add-remove", "keyed-hash shards").neighbouring == "add-remove"
