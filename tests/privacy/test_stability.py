"""The stability + sparse-vector mechanism (Bassily, Thakkar, Thakurta 2018): its distance is
sensitivity 1, its calibration meets the stated (ε, δ), and neighbouring histograms get
output distributions within e^ε·P + δ of each other."""
from __future__ import annotations

import functools
import itertools
import math
import threading

import numpy as np
import pytest
from scipy import stats

from privacy.accounting.rdp import DEFAULT_ORDERS, pure_dp_rdp
from privacy.mechanisms import ABSTAIN, Stability
from privacy.mechanisms.stability import composed_epsilon, distance_to_instability, laplace_difference_tail
from privacy.randomness import make_rng

RUNS = 10_000


def test_distance_hand_values():
    votes = np.array([[10, 5, 0], [10, 7, 1], [10, 8, 0], [6, 6, 0], [9, 10, 0], [0, 0, 0], [3, 12, 4]])
    # gap 5 → 2, gap 3 → 1, gap 2 → 0, tie → 0, gap 1 → 0, empty → 0, gap 8 → 3
    assert distance_to_instability(votes).tolist() == [2, 1, 0, 0, 0, 0, 3]


def test_distance_has_sensitivity_one_and_certifies_the_plurality():
    rng = make_rng(0)
    for votes in rng.multinomial(20, [0.5, 0.3, 0.1, 0.1], size=200):
        d = distance_to_instability(votes[None])[0]
        for a, b in itertools.permutations(range(4), 2):
            if votes[a] == 0:
                continue
            neighbour = votes.copy()
            neighbour[a] -= 1
            neighbour[b] += 1
            d_neighbour = distance_to_instability(neighbour[None])[0]
            assert abs(int(d) - int(d_neighbour)) <= 1
            if d >= 1:
                assert np.argmax(neighbour) == np.argmax(votes)


def test_laplace_difference_tail_matches_monte_carlo():
    rng = np.random.default_rng(1)
    diff = rng.laplace(0, 4.0, 400_000) - rng.laplace(0, 2.0, 400_000)
    for t in (-6.0, -1.0, 0.0, 2.5, 10.0):
        assert (diff >= t).mean() == pytest.approx(laplace_difference_tail(t, 4.0, 2.0), abs=3e-3)


@pytest.mark.parametrize("epsilon, delta, cap, queries", [(1.0, 1e-5, 20, 1000), (8.0, 1e-5, 3, 100), (1.0, 0.2, 1, 1)])
def test_calibration_meets_the_stated_guarantee(epsilon, delta, cap, queries):
    mechanism = Stability(epsilon, delta, cap, queries)
    eps1 = mechanism.instance_epsilon
    assert eps1 >= epsilon / cap  # never worse than basic composition
    assert composed_epsilon(eps1, cap, delta / 2) <= epsilon + 1e-12 or eps1 * cap <= epsilon + 1e-12
    assert (mechanism.query_scale, mechanism.threshold_scale) == pytest.approx((4 / eps1, 2 / eps1))
    assert queries * mechanism.failure_probability <= delta / 2
    assert queries * mechanism.failure_probability >= 0.999 * delta / 2  # and not wastefully high


def pass_probability(mechanism: Stability, distance: int) -> float:
    """P[d + ν ≥ w + ρ] for the first query of a fresh instance."""
    return laplace_difference_tail(mechanism.threshold - distance, mechanism.query_scale, mechanism.threshold_scale)


@functools.lru_cache(maxsize=None)
def _outcomes(histogram: tuple[int, ...], seed: int) -> tuple[int, int, int]:
    rng = make_rng(seed)
    votes = np.array([histogram])
    labels = np.array([Stability(1.0, 0.2, 1, 1)(votes, rng).labels[0] for _ in range(RUNS)])
    return int((labels == 0).sum()), int((labels == 1).sum()), int((labels == ABSTAIN).sum())


def single_query_outcomes(histogram: np.ndarray, seed: int) -> np.ndarray:
    """Outcome counts [class 0, class 1, ⊥] over RUNS fresh one-query runs (cached: runs are slow)."""
    return np.array(_outcomes(tuple(int(v) for v in histogram), seed))


@pytest.mark.parametrize(
    "first, second",
    [
        (np.array([125, 125]), np.array([124, 126])),  # the plurality flips: only δ covers it
        (np.array([130, 120]), np.array([129, 121])),  # d = 4 vs d = 3, same plurality
    ],
)
def test_neighbouring_histograms_respect_the_bound(first, second):
    mechanism = Stability(1.0, 0.2, 1, 1)  # one query, cap 1: a single ε′ = ε instance
    epsilon, delta = mechanism.guarantee()
    assert mechanism.instance_epsilon == epsilon

    def exact(histogram: np.ndarray) -> np.ndarray:
        p = pass_probability(mechanism, int(distance_to_instability(histogram[None])[0]))
        out = np.zeros(3)
        out[np.argmax(histogram)] = p
        out[2] = 1 - p
        return out

    p_first, p_second = exact(first), exact(second)
    # the stated bound holds exactly, both ways, for every outcome
    assert np.all(p_first <= math.exp(epsilon) * p_second + delta)
    assert np.all(p_second <= math.exp(epsilon) * p_first + delta)

    counts_first, counts_second = single_query_outcomes(first, 11), single_query_outcomes(second, 12)
    for counts, p in ((counts_first, p_first), (counts_second, p_second)):
        support = p > 0
        assert np.all(counts[~support] == 0)
        assert stats.chisquare(counts[support], RUNS * p[support]).pvalue > 1e-3
    # and empirically (tolerance: 4 binomial standard errors at these sample sizes)
    f1, f2 = counts_first / RUNS, counts_second / RUNS
    tolerance = 4 * np.sqrt(0.25 / RUNS) * (1 + math.exp(epsilon))
    assert np.all(f1 <= math.exp(epsilon) * f2 + delta + tolerance)
    assert np.all(f2 <= math.exp(epsilon) * f1 + delta + tolerance)


def test_a_distance_zero_query_passes_with_at_most_the_failure_probability():
    mechanism = Stability(1.0, 0.2, 1, 1)
    assert pass_probability(mechanism, 0) == pytest.approx(mechanism.failure_probability)
    counts = single_query_outcomes(np.array([125, 125]), 11)
    assert counts[1] == 0  # never the other class: on a tie class 0 is the plurality
    assert counts[0] / RUNS == pytest.approx(mechanism.failure_probability, abs=4 * math.sqrt(0.1 * 0.9 / RUNS))


STABLE, UNSTABLE = np.array([10_000, 0]), np.array([5_000, 5_000])


def test_run_releases_exact_pluralities_until_the_cap_then_abstains():
    mechanism = Stability(epsilon=8.0, delta=1e-5, max_unstable=3, max_queries=100)
    rng = make_rng(3)
    eps1, p0 = mechanism.instance_epsilon, mechanism.failure_probability

    first = mechanism(np.array([STABLE, STABLE]), rng)
    assert first.labels.tolist() == [0, 0]
    assert np.allclose(first.charge.rdp, pure_dp_rdp(DEFAULT_ORDERS, eps1))  # one instance
    assert first.charge.extra_delta == pytest.approx(2 * p0)

    # the open instance continues into this batch and is paid again; the ⊥ opens a second
    second = mechanism(np.array([STABLE, UNSTABLE, STABLE[::-1]]), rng)
    assert second.labels.tolist() == [0, ABSTAIN, 1]
    assert np.allclose(second.charge.rdp, 2 * pure_dp_rdp(DEFAULT_ORDERS, eps1))
    assert mechanism.unstable_count == 1 and not mechanism.exhausted

    worst = mechanism.worst_case_charge(10)
    assert np.allclose(worst.rdp, 2 * pure_dp_rdp(DEFAULT_ORDERS, eps1))  # only 2 ⊥s left
    assert worst.extra_delta == pytest.approx(10 * p0)

    third = mechanism(np.array([UNSTABLE, STABLE, UNSTABLE, STABLE, STABLE]), rng)
    assert third.labels.tolist() == [ABSTAIN, 0, ABSTAIN, ABSTAIN, ABSTAIN]  # cap reached at the third ⊥
    assert np.allclose(third.charge.rdp, 2 * pure_dp_rdp(DEFAULT_ORDERS, eps1))
    assert third.charge.extra_delta == pytest.approx(3 * p0)
    assert mechanism.exhausted
    assert np.all(third.charge.rdp <= worst.rdp + 1e-15)

    after = mechanism(np.array([STABLE] * 4), rng)
    assert np.all(after.labels == ABSTAIN)
    assert np.all(after.charge.rdp == 0) and after.charge.extra_delta == 0
    assert np.all(mechanism.worst_case_charge(4).rdp == 0)


def test_stops_after_max_queries():
    mechanism = Stability(epsilon=8.0, delta=1e-5, max_unstable=3, max_queries=5)
    result = mechanism(np.array([STABLE] * 8), make_rng(4))
    assert result.labels.tolist() == [0] * 5 + [ABSTAIN] * 3
    assert result.charge.extra_delta == pytest.approx(5 * mechanism.failure_probability)
    assert mechanism.exhausted


def test_concurrent_callers_never_pass_the_cap():
    mechanism = Stability(epsilon=8.0, delta=1e-5, max_unstable=25, max_queries=10_000)
    batch = np.array([UNSTABLE, STABLE] * 5)
    results, start = [], threading.Barrier(8)

    def worker(seed: int) -> None:
        rng = make_rng(seed)
        start.wait()
        for _ in range(5):
            results.append(mechanism(batch, rng))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    abstained_on_unstable = sum(int((r.labels[::2] == ABSTAIN).sum()) for r in results)
    assert mechanism.unstable_count == 25 and mechanism.exhausted
    assert abstained_on_unstable == 8 * 5 * 5  # every unstable query abstains, cap or not
    answered = np.concatenate([r.labels[1::2] for r in results])
    assert set(answered.tolist()) <= {0, ABSTAIN}
    assert (answered == 0).sum() == 24  # serialised: U S U S … U(25th) — then nothing more
