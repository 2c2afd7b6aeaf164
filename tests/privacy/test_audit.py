"""The one-run audit's ε lower bound (Steinke, Nasr & Jagielski, NeurIPS 2023, Thm 3.1),
checked against values worked out here independently of the module."""
from __future__ import annotations

import math

import pytest
from scipy import stats

from conclave.privacy.accounting.audit import THEOREM, epsilon_lower_bound, one_run_tail


def rr_accuracy(epsilon: float) -> float:
    """Accuracy of ε-DP randomized response: e^ε / (1 + e^ε)."""
    return math.exp(epsilon) / (1.0 + math.exp(epsilon))


def theorem_by_hand(epsilon: float, delta: float, m: int, r: int, v: int) -> float:
    """Thm 3.1's right-hand side, with the max over every i in 1..m as the theorem writes it."""
    p = rr_accuracy(epsilon)

    def f(k: int) -> float:
        return 1.0 if k <= 0 else float(stats.binom.sf(k - 1, r, p))

    spread = max((f(v - i) - f(v)) / i for i in range(1, m + 1))
    return min(1.0, f(v) + 2 * m * delta * spread)


@pytest.mark.parametrize("epsilon", [0.0, 0.3, 1.0, 2.5, 6.0])
@pytest.mark.parametrize(("r", "v"), [(1, 1), (20, 14), (100, 60), (100, 100), (500, 290)])
def test_pure_dp_tail_is_the_randomized_response_binomial(epsilon: float, r: int, v: int) -> None:
    expected = float(stats.binom.sf(v - 1, r, rr_accuracy(epsilon)))
    assert one_run_tail(epsilon, 0.0, 1000, r, v) == pytest.approx(expected, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize(("m", "r", "v", "epsilon", "delta"),
                         [(50, 40, 30, 0.5, 1e-3), (200, 100, 70, 1.0, 1e-5), (100, 100, 95, 2.0, 1e-2),
                          (30, 30, 20, 0.0, 0.05)])
def test_approximate_dp_tail_matches_the_theorem_written_out(m: int, r: int, v: int, epsilon: float,
                                                              delta: float) -> None:
    expected = theorem_by_hand(epsilon, delta, m, r, v)
    assert one_run_tail(epsilon, delta, m, r, v) == pytest.approx(expected, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize(("m", "r", "v", "confidence"),
                         [(1000, 100, 70, 0.95), (1000, 1000, 600, 0.95), (200, 200, 180, 0.99), (50, 10, 9, 0.9)])
def test_pure_dp_bound_inverts_the_binomial_tail(m: int, r: int, v: int, confidence: float) -> None:
    beta = 1.0 - confidence
    result = epsilon_lower_bound(m, r, v, 0.0, confidence)
    assert result.epsilon > 0
    at_bound = float(stats.binom.sf(v - 1, r, rr_accuracy(result.epsilon)))
    assert at_bound == pytest.approx(beta, abs=1e-6)
    assert at_bound <= beta  # the reported ε itself is rejected, not just its neighbourhood
    assert float(stats.binom.sf(v - 1, r, rr_accuracy(result.epsilon + 1e-3))) > beta


@pytest.mark.parametrize(("r", "confidence"), [(1, 0.5), (10, 0.95), (100, 0.95), (1000, 0.95), (1000, 0.99)])
def test_perfect_guessing_matches_the_closed_form(r: int, confidence: float) -> None:
    # All r correct: P[W = r] = p^r ≤ β  ⇔  p ≤ β^(1/r)  ⇔  ε ≤ logit(β^(1/r)).
    beta = 1.0 - confidence
    p = beta ** (1.0 / r)
    assert epsilon_lower_bound(r, r, r, 0.0, confidence).epsilon == pytest.approx(math.log(p / (1.0 - p)), abs=1e-8)


def test_perfect_guessing_ceiling_at_95_percent() -> None:
    # The ceiling any audit can reach with r guesses at δ = 0 and 95 %: logit(0.05^(1/r)),
    # worked out by hand to 4 digits (r = 100: p = 0.970487, ε = ln(32.883) = 3.4930;
    # r = 1000: p = 0.997009, ε = ln(333.31) = 5.8091). More guesses, higher ceiling.
    assert epsilon_lower_bound(100, 100, 100, 0.0).epsilon == pytest.approx(3.4930, abs=5e-4)
    assert epsilon_lower_bound(1000, 1000, 1000, 0.0).epsilon == pytest.approx(5.8091, abs=5e-4)


def test_more_correct_guesses_give_a_larger_bound() -> None:
    for delta in (0.0, 1e-5):
        bounds = [epsilon_lower_bound(1000, 200, v, delta).epsilon for v in range(100, 201, 10)]
        assert bounds[0] == 0.0
        assert all(a < b for a, b in zip(bounds[1:], bounds[2:]))


def test_larger_delta_gives_a_smaller_bound() -> None:
    bounds = [epsilon_lower_bound(1000, 500, 450, delta).epsilon for delta in (0.0, 1e-6, 1e-5, 1e-4, 1e-3)]
    assert all(later < earlier for earlier, later in zip(bounds, bounds[1:]))


def test_tail_grows_with_epsilon_and_shrinks_with_v() -> None:
    epsilons = [0.1 * k for k in range(0, 80)]
    for delta in (0.0, 1e-5, 1e-2):
        tails = [one_run_tail(e, delta, 300, 100, 75) for e in epsilons]
        assert all(b >= a for a, b in zip(tails, tails[1:]))
        by_v = [one_run_tail(1.5, delta, 300, 100, v) for v in range(0, 101)]
        assert all(b <= a for a, b in zip(by_v, by_v[1:]))


def test_approximate_dp_bound_is_rejected_at_its_own_epsilon() -> None:
    result = epsilon_lower_bound(1000, 600, 600, 1e-5, 0.95)
    assert 0 < result.epsilon < epsilon_lower_bound(1000, 600, 600, 0.0, 0.95).epsilon
    assert theorem_by_hand(result.epsilon, 1e-5, 1000, 600, 600) <= 0.05
    assert theorem_by_hand(result.epsilon + 1e-3, 1e-5, 1000, 600, 600) > 0.05


@pytest.mark.parametrize(("r", "v"), [(0, 0), (100, 0), (100, 30), (100, 50), (101, 50)])
def test_chance_or_worse_certifies_nothing(r: int, v: int) -> None:
    assert epsilon_lower_bound(1000, r, v, 1e-5).epsilon == 0.0


def test_too_few_guesses_to_be_significant_certify_nothing() -> None:
    # 3 of 4 right is better than chance, but P[≥ 3 of 4] = 5/16 at ε = 0 is not ≤ 0.05.
    assert epsilon_lower_bound(10, 4, 3, 0.0).epsilon == 0.0


def test_result_records_its_inputs() -> None:
    result = epsilon_lower_bound(500, 200, 150, 1e-6, confidence=0.99)
    assert (result.m, result.r, result.v, result.delta, result.confidence) == (500, 200, 150, 1e-6, 0.99)
    assert result.theorem == THEOREM


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"m": 10, "r": 11, "v": 5}, "v <= r <= m"),
    ({"m": 10, "r": 5, "v": 6}, "v <= r <= m"),
    ({"m": 10, "r": 5, "v": -1}, "v <= r <= m"),
    ({"m": 10, "r": 5.0, "v": 3}, "integers"),
    ({"delta": -0.1}, "delta"),
    ({"delta": 1.0}, "delta"),
    ({"confidence": 0.0}, "confidence"),
    ({"confidence": 1.0}, "confidence"),
    ({"confidence": float("nan")}, "confidence"),
])
def test_bad_input_is_named(kwargs: dict, message: str) -> None:
    args = {"m": 10, "r": 5, "v": 4, "delta": 0.0, "confidence": 0.95} | kwargs
    with pytest.raises(ValueError, match=message):
        epsilon_lower_bound(**args)


@pytest.mark.parametrize("epsilon", [-1.0, math.inf, math.nan])
def test_tail_rejects_a_bad_epsilon(epsilon: float) -> None:
    with pytest.raises(ValueError, match="epsilon"):
        one_run_tail(epsilon, 0.0, 10, 5, 3)
