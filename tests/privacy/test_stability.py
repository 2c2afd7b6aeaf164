"""The stability + sparse-vector mechanism (Bassily, Thakkar, Thakurta 2018, calibrated as Lyu,
Su & Li 2017, Alg. 1): its distance is sensitivity 1, its calibration meets the stated (ε, δ),
neighbouring histograms get output distributions within e^ε·P + δ of each other, the
propose-test-release failure stays within c·p₀, and the ledger pays for a run once."""
from __future__ import annotations

import functools
import itertools
import math
import threading

import numpy as np
import pytest
from scipy import stats

from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, pure_dp_rdp
from conclave.privacy.mechanisms import ABSTAIN, Stability
from conclave.privacy.mechanisms.stability import distance_to_instability, laplace_difference_tail

RUNS = 10_000


def test_distance_hand_values():
    votes = np.array([[10, 5, 0], [10, 7, 1], [10, 8, 0], [6, 6, 0], [9, 10, 0], [0, 0, 0], [3, 12, 4]])
    # gap 5 → 2, gap 3 → 1, gap 2 → 0, tie → 0, gap 1 → 0, empty → 0, gap 8 → 3
    assert distance_to_instability(votes).tolist() == [2, 1, 0, 0, 0, 0, 3]


def test_distance_has_sensitivity_one_and_certifies_the_plurality():
    rng = np.random.default_rng(0)
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


@pytest.mark.parametrize("epsilon, delta, cap", [(1.0, 1e-5, 20), (8.0, 1e-5, 3), (1.0, 0.2, 1)])
def test_calibration_meets_the_stated_guarantee(epsilon, delta, cap):
    mechanism = Stability(epsilon, delta, cap)
    epsilon1 = epsilon / (1 + (2 * cap) ** (2 / 3))  # Lyu et al.'s allocation between ρ and ν
    assert mechanism.calibration.threshold_scale == pytest.approx(1 / epsilon1)
    assert mechanism.calibration.query_scale == pytest.approx(2 * cap / (epsilon - epsilon1))
    assert cap * mechanism.calibration.failure_probability <= delta  # the union over c segments
    assert cap * mechanism.calibration.failure_probability >= 0.999 * delta  # and not wastefully low


def test_threshold_at_one_abstention():
    # ε = 1, δ = 1e-5, c = 1: ρ ~ Lap(2.587), ν ~ Lap(3.260); Pr[ν − ρ ≥ w] = δ at w ≈ 38.4
    # (about 79 votes of margin), where a union over 1,000 queries needed w ≈ 75.
    mechanism = Stability(1.0, 1e-5, 1)
    assert mechanism.calibration.threshold == pytest.approx(38.415, abs=0.01)


def pass_probability(mechanism: Stability, distance: int) -> float:
    """P[d + ν ≥ w + ρ] for the first query of a fresh instance."""
    scales = mechanism.calibration
    return laplace_difference_tail(scales.threshold - distance, scales.query_scale, scales.threshold_scale)


@functools.lru_cache(maxsize=None)
def _outcomes(histogram: tuple[int, ...], seed: int) -> tuple[int, int, int]:
    rng = np.random.default_rng(seed)
    votes = np.array([histogram])
    labels = np.array([Stability(1.0, 0.2, 1)(votes, rng).labels[0] for _ in range(RUNS)])
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
    mechanism = Stability(1.0, 0.2, 1)  # one query: the whole run's (ε, δ) applies to it
    epsilon, delta = mechanism.epsilon, mechanism.delta

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
    mechanism = Stability(1.0, 0.2, 1)
    assert pass_probability(mechanism, 0) == pytest.approx(mechanism.calibration.failure_probability)
    counts = single_query_outcomes(np.array([125, 125]), 11)
    assert counts[1] == 0  # never the other class: on a tie class 0 is the plurality
    assert counts[0] / RUNS == pytest.approx(mechanism.calibration.failure_probability,
                                             abs=4 * math.sqrt(0.1 * 0.9 / RUNS))


def test_propose_test_release_fails_at_most_c_times_p0():
    """Monte Carlo over whole runs on a stream that keeps offering distance-0 queries between
    stable ones: the share of runs in which some distance-0 query passed stays within c·p₀."""
    cap = 4
    mechanism_of = lambda: Stability(1.0, 0.4, cap)  # p₀ = δ/c = 0.1
    p0 = mechanism_of().calibration.failure_probability
    stream = np.array([[120, 0], [5, 5]] * 20)  # d = 59, then d = 0, twenty times
    runs, failed = 3000, 0
    rng = np.random.default_rng(7)
    for _ in range(runs):
        mechanism = mechanism_of()
        labels = mechanism(stream, rng).labels
        failed += bool(np.any(labels[1::2] != ABSTAIN))  # a tie answered: the test failed on an unstable query
    rate, bound = failed / runs, cap * p0
    assert rate <= bound + 4 * math.sqrt(bound * (1 - bound) / runs)
    assert rate > p0  # more than one segment's worth: the union over segments is needed


STABLE, UNSTABLE = np.array([10_000, 0]), np.array([5_000, 5_000])


def committed(mechanism: Stability, votes: np.ndarray, rng: np.random.Generator):
    result = mechanism(votes, rng)
    result.commit()
    return result


def test_run_releases_exact_pluralities_until_the_cap_then_abstains():
    mechanism = Stability(epsilon=8.0, delta=1e-5, max_unstable=3)
    rng = np.random.default_rng(3)
    whole_run = pure_dp_rdp(DEFAULT_ORDERS, 8.0)

    assert np.allclose(mechanism.worst_case_charge(2).rdp, whole_run)  # reserved before the run opens
    first = committed(mechanism, np.array([STABLE, STABLE]), rng)
    assert first.labels.tolist() == [0, 0]
    assert np.allclose(first.charge.rdp, whole_run) and first.charge.extra_delta == 1e-5  # paid once, in full

    second = committed(mechanism, np.array([STABLE, UNSTABLE, STABLE[::-1]]), rng)
    assert second.labels.tolist() == [0, ABSTAIN, 1]
    assert np.all(second.charge.rdp == 0) and second.charge.extra_delta == 0  # the open run costs nothing more
    assert mechanism.unstable_count == 1 and not mechanism.exhausted
    assert np.all(mechanism.worst_case_charge(10).rdp == 0)

    third = committed(mechanism, np.array([UNSTABLE, STABLE, UNSTABLE, STABLE, STABLE]), rng)
    assert third.labels.tolist() == [ABSTAIN, 0, ABSTAIN, ABSTAIN, ABSTAIN]  # stopped at the third ⊥
    assert mechanism.exhausted

    after = committed(mechanism, np.array([STABLE] * 4), rng)
    assert np.all(after.labels == ABSTAIN)
    assert np.all(after.charge.rdp == 0) and after.charge.extra_delta == 0


def test_stops_after_max_queries():
    mechanism = Stability(epsilon=8.0, delta=1e-5, max_unstable=3, max_queries=5)
    result = committed(mechanism, np.array([STABLE] * 8), np.random.default_rng(4))
    assert result.labels.tolist() == [0] * 5 + [ABSTAIN] * 3
    assert mechanism.exhausted


def test_state_advances_only_on_commit():
    mechanism = Stability(epsilon=8.0, delta=1e-5, max_unstable=3)
    refused = mechanism(np.array([UNSTABLE, UNSTABLE]), np.random.default_rng(5))
    assert refused.labels.tolist() == [ABSTAIN, ABSTAIN]
    # not committed (the ledger refused it): nothing moved, and the run is still unopened
    assert mechanism.unstable_count == 0 and not mechanism.opened
    assert np.allclose(mechanism.worst_case_charge(1).rdp, pure_dp_rdp(DEFAULT_ORDERS, 8.0))
    accepted = mechanism(np.array([UNSTABLE]), np.random.default_rng(6))
    accepted.commit()
    assert mechanism.unstable_count == 1 and mechanism.opened
    with pytest.raises(RuntimeError, match="state moved"):
        refused.commit()  # computed from a state that is gone


def test_a_ledger_pays_for_a_run_once_however_many_batches(tmp_path):
    mechanism = Stability(epsilon=1.0, delta=1e-6, max_unstable=5)
    rng = np.random.default_rng(8)
    with PrivacyLedger(tmp_path / "ledger.db", 1e-5) as ledger:
        for _ in range(1000):  # one-query batches, as a streaming client sends them
            worst = mechanism.worst_case_charge(1).for_records(Neighbouring.ADD_REMOVE, "one teacher per record")
            result = mechanism(np.array([STABLE]), rng)
            if not result.charge.is_free:
                ledger.charge(result.charge.for_records(Neighbouring.ADD_REMOVE, "one teacher per record"),
                              worst_case=worst)
            result.commit()
        spent = ledger.spent()
        assert ledger.report().charges == 1
    assert np.allclose(spent.rdp, pure_dp_rdp(DEFAULT_ORDERS, 1.0)) and spent.extra_delta == 1e-6


def test_concurrent_callers_never_pass_the_cap():
    mechanism = Stability(epsilon=8.0, delta=1e-5, max_unstable=25)
    batch = np.array([UNSTABLE, STABLE] * 5)
    results, start = [], threading.Barrier(8)

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        start.wait()
        for _ in range(5):
            while True:  # optimistic: a batch computed from a state another caller moved is rerun
                result = mechanism(batch, rng)
                try:
                    result.commit()
                    break
                except RuntimeError:
                    continue
            results.append(result)

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
