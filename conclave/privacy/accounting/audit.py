"""The one-run audit's lower bound on ε: from a count of correct membership guesses to an ε
that the algorithm cannot satisfy, at a stated confidence.

Steinke, Nasr & Jagielski (NeurIPS 2023), Theorem 3.1: ``one_run_tail`` is its right-hand side,
``epsilon_lower_bound`` the largest ε an observed count rejects. Pure arithmetic on counts; the
audit runs live in ``cluster.auditing``. docs/privacy.md, "The one-run audit".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import special
from conclave.errors import InvalidValue

THEOREM = "Steinke, Nasr & Jagielski, NeurIPS 2023, Thm 3.1 (one-run audit, (eps, delta)-DP)"

# Bisection stops once the bracket is this narrow; the tail moves by far less than any
# confidence a caller could state over such a step.
_EPSILON_TOLERANCE = 1e-12
_MAX_BISECTIONS = 200


@dataclass(frozen=True)
class AuditBound:
    """``epsilon``: at confidence ``confidence``, the audited algorithm is not (ε', ``delta``)-DP
    for any ε' < ``epsilon`` (0 when the guesses certify nothing), from ``v`` correct guesses
    out of ``r`` made on ``m`` canaries, by ``theorem``."""

    epsilon: float
    confidence: float
    m: int
    r: int
    v: int
    delta: float
    theorem: str = THEOREM


def _check_counts(m: int, r: int, v: int) -> None:
    for name, value in (("m", m), ("r", r), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise InvalidValue(f"audit counts must be integers, got {name}={value!r}")
    if not 0 <= v <= r <= m:
        raise InvalidValue(f"audit counts need 0 <= v <= r <= m, got m={m}, r={r}, v={v}")


def _check_delta(delta: float) -> None:
    if not 0.0 <= delta < 1.0:
        raise InvalidValue(f"delta must be in [0, 1), got {delta!r}")


def one_run_tail(epsilon: float, delta: float, m: int, r: int, v: int) -> float:
    """Theorem 3.1's bound on P[at least ``v`` of ``r`` guesses correct] for an
    (``epsilon``, ``delta``)-DP algorithm auditing ``m`` canaries, capped at 1."""
    _check_counts(m, r, v)
    _check_delta(delta)
    if not 0.0 <= epsilon < math.inf:
        raise InvalidValue(f"epsilon must be finite and >= 0, got {epsilon!r}")
    if v == 0:
        return 1.0
    from scipy import stats  # here: every CLI process imports this module (through the pipelines), few audit

    p = float(special.expit(epsilon))
    tail = float(stats.binom.sf(v - 1, r, p))  # f(v)
    if delta == 0.0:
        return min(tail, 1.0)
    # f(v − i) − f(v) = P[v − i ≤ Binomial < v]: running sums of the pmf below v. Only
    # i ≤ v matters: past it f(v − i) = 1, so the ratio only shrinks as i grows.
    below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, p)
    ratio = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(tail + 2.0 * m * delta * ratio, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95) -> AuditBound:
    """The largest ε whose Theorem 3.1 tail at ``v`` is still ≤ β = 1 − ``confidence``.

    Bisection keeps the invariant tail(lo) ≤ β < tail(hi), so the ε returned is always one
    the test rejects, hence sound; the tail grows with ε (to 1 as ε → ∞ whenever v ≤ r),
    so it is also the largest. Guesses at or below chance (v ≤ r/2) certify nothing: 0.
    """
    _check_counts(m, r, v)
    _check_delta(delta)
    if not 0.0 < confidence < 1.0:
        raise InvalidValue(f"confidence must be in (0, 1), got {confidence!r}")
    beta = 1.0 - confidence

    def bound(epsilon: float) -> AuditBound:
        return AuditBound(epsilon=epsilon, confidence=confidence, m=m, r=r, v=v, delta=delta)

    if 2 * v <= r or one_run_tail(0.0, delta, m, r, v) > beta:
        return bound(0.0)
    lo, hi = 0.0, 1.0
    while one_run_tail(hi, delta, m, r, v) <= beta:
        lo, hi = hi, 2.0 * hi
    for _ in range(_MAX_BISECTIONS):
        if hi - lo <= _EPSILON_TOLERANCE * max(1.0, hi):
            break
        mid = 0.5 * (lo + hi)
        if one_run_tail(mid, delta, m, r, v) <= beta:
            lo = mid
        else:
            hi = mid
    return bound(lo)
