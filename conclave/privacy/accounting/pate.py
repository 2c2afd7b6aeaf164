"""Data-dependent Rényi-DP analysis of PATE's noisy-argmax aggregators, and the privacy report.

Pure functions of the vote histograms, the noise and the orders, each named after the result it
implements: LNMax (PATE 2017, Lemma 4, Thm 3), GNMax (PATE 2018, Props. 7, 8, 10, Thm 6) and
Confident-GNMax's threshold at √2·σ₁. A data-dependent bound is an ``Estimate`` marked private,
never a guarantee; ``privacy.accounting.smooth_sensitivity`` releases it.
"""
from __future__ import annotations

import math

import numpy as np
from scipy import special

from conclave.errors import InvalidValue
from conclave.privacy.accounting import rdp as rdp_lib
from conclave.privacy.accounting.guarantee import Estimate

# ---------------------------------------------------------------------------------------
# small numerics


def log1mexp(x: np.ndarray | float) -> np.ndarray:
    """log(1 − eˣ) for x ≤ 0, stable at both ends (−inf at x = 0, 0 at x = −inf)."""
    x = np.asarray(x, dtype=float)
    if np.any(x > 0):
        raise InvalidValue("log1mexp needs x <= 0")
    with np.errstate(divide="ignore"):
        # log1p(−eˣ) is accurate for very negative x, log(−expm1(x)) near 0.
        return np.where(x < -math.log(2), np.log1p(-np.exp(x)), np.log(-np.expm1(x)))


def _log_normal_tail(x: np.ndarray | float, scale: float) -> np.ndarray:
    """log Pr[N(0, scale²) ≥ x], accurate far into the tail (scipy.stats' logsf, without its import cost)."""
    return special.log_ndtr(-np.asarray(x, dtype=float) / scale)


def _as_orders(orders: np.ndarray | list[float] | float) -> np.ndarray:
    orders = np.atleast_1d(np.asarray(orders, dtype=float))
    if orders.ndim != 1 or orders.size == 0 or np.any(orders <= 1):
        raise InvalidValue("RDP orders must be a non-empty list of numbers > 1")
    return orders


def _as_votes(votes: np.ndarray) -> np.ndarray:
    votes = np.asarray(votes)
    if votes.ndim == 1:
        votes = votes[None, :]
    if votes.ndim != 2 or votes.shape[1] == 0:
        raise InvalidValue(f"votes must be [queries, classes], got shape {votes.shape}")
    return votes.astype(float)


def _cap_logq(logq: np.ndarray, num_classes: int) -> np.ndarray:
    # A noisy argmax is never worse than uniform guessing among k classes: q ≤ 1 − 1/k.
    with np.errstate(divide="ignore"):
        return np.minimum(logq, math.log1p(-1.0 / num_classes) if num_classes > 1 else -np.inf)


def _logq_union(log_terms: np.ndarray, votes: np.ndarray) -> np.ndarray:
    """log Σ_{j≠j*} term_j per row: the plurality's own term is dropped (one index, ties kept)."""
    top = np.argmax(votes, axis=1)
    log_terms = log_terms.copy()
    log_terms[np.arange(votes.shape[0]), top] = -np.inf
    with np.errstate(divide="ignore"):
        return special.logsumexp(log_terms, axis=1) if votes.shape[1] > 1 else np.full(votes.shape[0], -np.inf)


# ---------------------------------------------------------------------------------------
# LNMax — PATE 2017


def lnmax_epsilon0(laplace_scale: float) -> float:
    """Pure ε of one LNMax answer: 2γ = 2/b (PATE 2017, Thm 2; the histogram moves in 2 places)."""
    if laplace_scale <= 0:
        raise InvalidValue("laplace_scale must be > 0")
    return 2.0 / laplace_scale


def lnmax_rdp_data_independent(laplace_scale: float, orders) -> np.ndarray:
    """RDP of one ε₀-DP answer: min(λε₀²/2, ε₀) (Bun & Steinke 2016 Prop 3.3; Mironov 2017)."""
    orders = _as_orders(orders)
    eps0 = lnmax_epsilon0(laplace_scale)
    return np.minimum(orders * eps0**2 / 2.0, eps0)


def lnmax_logq(votes: np.ndarray, laplace_scale: float) -> np.ndarray:
    """log of the Lemma 4 bound (PATE 2017): q ≤ Σ_{j≠j*} (2 + γΔ_j) / (4 e^{γΔ_j}), Δ_j = n_j* − n_j.

    Capped at 1 − 1/k. One value per query (row of ``votes``).
    """
    votes = _as_votes(votes)
    if laplace_scale <= 0:
        raise InvalidValue("laplace_scale must be > 0")
    gamma = 1.0 / laplace_scale
    gaps = gamma * (votes.max(axis=1, keepdims=True) - votes)
    log_terms = np.log(2.0 + gaps) - math.log(4.0) - gaps
    return _cap_logq(_logq_union(log_terms, votes), votes.shape[1])


def lnmax_rdp(logq: np.ndarray | float, laplace_scale: float, orders) -> np.ndarray:
    """Data-dependent RDP of one LNMax answer, PATE 2017 Theorem 3 written at order λ = l + 1.

    min(λε₀²/2, ε₀, T(λ)) with, when q ≤ 1/(e^ε₀ + 1),
    T(λ) = log[(1−q)·((1−q)/(1 − e^ε₀·q))^(λ−1) + q·e^(ε₀(λ−1))] / (λ−1).
    Returns [len(logq), len(orders)].
    """
    orders = _as_orders(orders)
    logq = np.atleast_1d(np.asarray(logq, dtype=float))[:, None]
    if np.any(logq > 0):
        raise InvalidValue("log q must be <= 0")
    eps0 = lnmax_epsilon0(laplace_scale)
    bound = np.broadcast_to(lnmax_rdp_data_independent(laplace_scale, orders), (logq.shape[0], orders.size)).copy()
    applies = (logq <= -math.log1p(math.exp(eps0)))[:, 0]  # q ≤ 1/(e^ε₀ + 1)
    if np.any(applies):
        lq = logq[applies]
        log1q = log1mexp(lq)
        log_t = np.logaddexp(
            log1q + (orders - 1) * (log1q - log1mexp(np.minimum(eps0 + lq, 0.0))),
            lq + eps0 * (orders - 1),
        )
        bound[applies] = np.minimum(bound[applies], log_t / (orders - 1))
    return np.maximum(bound, 0.0)


# ---------------------------------------------------------------------------------------
# GNMax — PATE 2018


def gnmax_rdp_data_independent(sigma: float, orders) -> np.ndarray:
    """PATE 2018 Proposition 8: GNMax with noise N(0, σ²) is (λ, λ/σ²)-RDP."""
    if sigma <= 0:
        raise InvalidValue("sigma must be > 0")
    return _as_orders(orders) / sigma**2


def gnmax_logq(votes: np.ndarray, sigma: float) -> np.ndarray:
    """PATE 2018 Proposition 7: q ≤ Σ_{j≠j*} Pr[N(0, 2σ²) ≥ n_j* − n_j], capped at 1 − 1/k."""
    votes = _as_votes(votes)
    if sigma <= 0:
        raise InvalidValue("sigma must be > 0")
    gaps = votes.max(axis=1, keepdims=True) - votes
    log_terms = _log_normal_tail(gaps, math.sqrt(2.0) * sigma)
    return _cap_logq(_logq_union(log_terms, votes), votes.shape[1])


def gnmax_mu(logq: np.ndarray, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """PATE 2018 Proposition 10: the higher orders μ₂ = σ·sqrt(log 1/q), μ₁ = μ₂ + 1."""
    mu2 = sigma * np.sqrt(-np.asarray(logq, dtype=float))
    return mu2 + 1.0, mu2


def gnmax_theorem6_applies(logq: np.ndarray | float, sigma: float, orders) -> np.ndarray:
    """Where Theorem 6 (with Prop 10's μ₁, μ₂) may be used, as a bool array [len(logq), len(orders)].

    At order λ it needs μ₁ > λ and μ₂ > 1; for q it needs
    log q ≤ (μ₂ − 1)·ε₂ − μ₂·(log(1 + 1/(μ₁ − 1)) + log(1 + 1/(μ₂ − 1))) and −log q > ε₂,
    with ε_i = μ_i/σ² (the data-independent RDP at order μ_i).
    """
    orders = _as_orders(orders)
    logq = np.atleast_1d(np.asarray(logq, dtype=float))
    mu1, mu2 = gnmax_mu(logq, sigma)
    eps2 = mu2 / sigma**2
    with np.errstate(divide="ignore", invalid="ignore"):
        q_ok = (
            (mu2 > 1)
            & (logq <= (mu2 - 1) * eps2 - mu2 * (np.log1p(1 / (mu1 - 1)) + np.log1p(1 / (mu2 - 1))))
            & (-logq > eps2)
            & np.isfinite(logq)
        )
    return q_ok[:, None] & (mu1[:, None] > orders[None, :])


def gnmax_theorem6(logq: np.ndarray | float, sigma: float, orders) -> np.ndarray:
    """The raw Theorem 6 expression (PATE 2018), without checking where it applies.

    (1/(λ−1))·log[(1−q)·A^(λ−1) + q·B^(λ−1)],
    A = (1−q)/(1 − (q·e^ε₂)^((μ₂−1)/μ₂)), B = e^ε₁ / q^(1/(μ₁−1)), computed in log space.
    Callers use ``gnmax_rdp``; this is exposed for the smooth-sensitivity analysis.
    """
    orders = _as_orders(orders)
    logq = np.atleast_1d(np.asarray(logq, dtype=float))[:, None]
    mu1, mu2 = gnmax_mu(logq, sigma)
    eps1, eps2 = mu1 / sigma**2, mu2 / sigma**2
    with np.errstate(divide="ignore", invalid="ignore"):  # NaN/inf outside its domain, by design
        log1q = log1mexp(logq)
        log_a = log1q - log1mexp(np.minimum((logq + eps2) * (1 - 1 / mu2), 0.0))
        log_b = eps1 - logq / (mu1 - 1)
        return np.logaddexp(log1q + (orders - 1) * log_a, logq + (orders - 1) * log_b) / (orders - 1)


def gnmax_rdp(logq: np.ndarray | float, sigma: float, orders) -> np.ndarray:
    """Data-dependent RDP of one GNMax answer: Theorem 6 where Prop 10's conditions hold,
    the data-independent λ/σ² elsewhere, always the minimum of the two; q = 0 costs 0.

    Returns [len(logq), len(orders)].
    """
    orders = _as_orders(orders)
    logq = np.atleast_1d(np.asarray(logq, dtype=float))
    if np.any(logq > 0):
        raise InvalidValue("log q must be <= 0")
    bound = np.tile(gnmax_rdp_data_independent(sigma, orders), (logq.size, 1))
    applies = gnmax_theorem6_applies(logq, sigma, orders)
    rows = np.any(applies, axis=1)
    if np.any(rows):
        dependent = gnmax_theorem6(logq[rows], sigma, orders)
        bound[rows] = np.where(applies[rows], np.minimum(bound[rows], dependent), bound[rows])
    bound[np.isneginf(logq)] = 0.0  # a fixed outcome reveals nothing
    return np.maximum(bound, 0.0)


# ---------------------------------------------------------------------------------------
# Threshold step of Confident-GNMax — PATE 2018 §4.1 / App. B


def threshold_logq(votes: np.ndarray, threshold: float, sigma1: float) -> np.ndarray:
    """log q for the threshold step: the less likely of its two outcomes, min(log p, log(1 − p))."""
    votes = _as_votes(votes)
    if sigma1 <= 0:
        raise InvalidValue("sigma1 must be > 0")
    gap = threshold - votes.max(axis=1)
    return np.minimum(_log_normal_tail(gap, sigma1), _log_normal_tail(-gap, sigma1))


def threshold_rdp(logq: np.ndarray | float, sigma1: float, orders) -> np.ndarray:
    """Data-dependent RDP of the threshold step: ``gnmax_rdp`` at √2·σ₁ with the step's log q."""
    return gnmax_rdp(logq, math.sqrt(2.0) * sigma1, orders)


# ---------------------------------------------------------------------------------------
# the data-dependent total as an estimate


def data_dependent_estimate(per_query_rdp: np.ndarray, orders: np.ndarray, delta: float, conversion: str,
                            source: str) -> Estimate:
    """The data-dependent ε of a run from its per-query bounds [queries, orders], labelled private:
    it is computed from the private votes without a mechanism (publish only a release of it)."""
    total = np.asarray(per_query_rdp, dtype=float).sum(axis=0)
    epsilon, order = rdp_lib.epsilon_from_rdp(orders, total, delta, conversion)
    return Estimate(
        "data-dependent", epsilon, delta, source, private=True,
        details={"order": None if math.isnan(order) else order, "conversion": conversion,
                 "note": "computed from the private votes: holds at this dataset only, and may not be published"},
    )
