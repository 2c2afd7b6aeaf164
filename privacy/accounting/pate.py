"""Data-dependent Rényi-DP analysis of PATE's noisy-argmax aggregators, and the privacy report.

Every bound here is a pure function of the vote histograms ``int[queries, k]``, the noise
parameters and the RDP orders λ, named after the result it implements:

- LNMax (Papernot et al., ICLR 2017): ``lnmax_logq`` = Lemma 4 (union bound on
  q = Pr[answer ≠ plurality], capped at 1 − 1/k); ``lnmax_rdp`` = Theorem 3 as RDP (the
  minimum of λε₀²/2, ε₀ and the data-dependent moment bound, ε₀ = 2/b).
- GNMax (Papernot et al., ICLR 2018): ``gnmax_logq`` = Proposition 7 (q bound through
  N(0, 2σ²) tails, capped at 1 − 1/k); ``gnmax_rdp_data_independent`` = Proposition 8
  (λ/σ²); ``gnmax_rdp`` = Theorem 6 with the higher orders μ₁, μ₂ of Proposition 10, used
  only where its conditions hold, and never above the data-independent bound.
- Confident-GNMax's threshold step: the same bounds at √2·σ₁ (its input, max_j n_j, has
  sensitivity 1 where GNMax's histogram moves by 2 in L2² terms), with
  log q = min(log p, log(1 − p)), p = Pr[N(0, σ₁²) ≥ T − max_j n_j].

A data-dependent bound is itself a function of the private votes, so it is never
published as is: ``privacy_report`` adds the smooth-sensitivity release of PATE 2018
(see ``privacy.accounting.smooth_sensitivity``) and labels the raw figure as private.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import special

from privacy.accounting import rdp as rdp_lib
from privacy.mechanisms.nzc import CLAIM_SOURCE, UNSOUND_REASON
from privacy.randomness import make_rng

# ---------------------------------------------------------------------------------------
# small numerics


def log1mexp(x: np.ndarray | float) -> np.ndarray:
    """log(1 − eˣ) for x ≤ 0, stable at both ends (−inf at x = 0, 0 at x = −inf)."""
    x = np.asarray(x, dtype=float)
    if np.any(x > 0):
        raise ValueError("log1mexp needs x <= 0")
    with np.errstate(divide="ignore"):
        # log1p(−eˣ) is accurate for very negative x, log(−expm1(x)) near 0.
        return np.where(x < -math.log(2), np.log1p(-np.exp(x)), np.log(-np.expm1(x)))


def _log_normal_tail(x: np.ndarray | float, scale: float) -> np.ndarray:
    """log Pr[N(0, scale²) ≥ x], accurate far into the tail (scipy.stats' logsf, without its import cost)."""
    return special.log_ndtr(-np.asarray(x, dtype=float) / scale)


def _as_orders(orders: np.ndarray | list[float] | float) -> np.ndarray:
    orders = np.atleast_1d(np.asarray(orders, dtype=float))
    if orders.ndim != 1 or orders.size == 0 or np.any(orders <= 1):
        raise ValueError("RDP orders must be a non-empty list of numbers > 1")
    return orders


def _as_votes(votes: np.ndarray) -> np.ndarray:
    votes = np.asarray(votes)
    if votes.ndim == 1:
        votes = votes[None, :]
    if votes.ndim != 2 or votes.shape[1] == 0:
        raise ValueError(f"votes must be [queries, classes], got shape {votes.shape}")
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
        raise ValueError("laplace_scale must be > 0")
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
        raise ValueError("laplace_scale must be > 0")
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
        raise ValueError("log q must be <= 0")
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
        raise ValueError("sigma must be > 0")
    return _as_orders(orders) / sigma**2


def gnmax_logq(votes: np.ndarray, sigma: float) -> np.ndarray:
    """PATE 2018 Proposition 7: q ≤ Σ_{j≠j*} Pr[N(0, 2σ²) ≥ n_j* − n_j], capped at 1 − 1/k."""
    votes = _as_votes(votes)
    if sigma <= 0:
        raise ValueError("sigma must be > 0")
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
        raise ValueError("log q must be <= 0")
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


def threshold_logp_answered(votes: np.ndarray, threshold: float, sigma1: float) -> np.ndarray:
    """log p, p = Pr[max_j n_j + N(0, σ₁²) ≥ T], one value per query."""
    votes = _as_votes(votes)
    if sigma1 <= 0:
        raise ValueError("sigma1 must be > 0")
    return _log_normal_tail(threshold - votes.max(axis=1), sigma1)


def threshold_logq(votes: np.ndarray, threshold: float, sigma1: float) -> np.ndarray:
    """log q for the threshold step: the less likely of its two outcomes, min(log p, log(1 − p))."""
    votes = _as_votes(votes)
    if sigma1 <= 0:
        raise ValueError("sigma1 must be > 0")
    gap = threshold - votes.max(axis=1)
    return np.minimum(_log_normal_tail(gap, sigma1), _log_normal_tail(-gap, sigma1))


def threshold_rdp_data_independent(sigma1: float, orders) -> np.ndarray:
    """λ/(2σ₁²): the Gaussian bound at √2·σ₁ (sensitivity 1 instead of GNMax's 2)."""
    return gnmax_rdp_data_independent(math.sqrt(2.0) * sigma1, orders)


def threshold_rdp(logq: np.ndarray | float, sigma1: float, orders) -> np.ndarray:
    """Data-dependent RDP of the threshold step: ``gnmax_rdp`` at √2·σ₁ with the step's log q."""
    return gnmax_rdp(logq, math.sqrt(2.0) * sigma1, orders)


# ---------------------------------------------------------------------------------------
# per-query costs of a run, and its privacy report

MECHANISMS = ("lnmax", "gnmax", "confident-gnmax", "nzc", "stability")


@dataclass(frozen=True)
class QueryCosts:
    """Per-query RDP of a run, [queries, len(orders)]; totals add up over the queries.

    ``answered`` marks the queries whose answer was released (the rest were abstentions,
    which Confident-GNMax still pays the threshold step for).
    """

    orders: np.ndarray
    data_independent: np.ndarray
    data_dependent: np.ndarray
    answered: np.ndarray

    @property
    def total_data_independent(self) -> np.ndarray:
        return self.data_independent.sum(axis=0)

    @property
    def total_data_dependent(self) -> np.ndarray:
        return self.data_dependent.sum(axis=0)


def validate_votes(votes: np.ndarray, answered: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Checked (votes int64 [queries, k], answered bool [queries]); ValueError names the problem."""
    votes = np.asarray(votes)
    if votes.ndim != 2:
        raise ValueError(f"votes must be a 2-D array [queries, classes], got {votes.ndim}-D shape {votes.shape}")
    if votes.size == 0:
        raise ValueError(f"votes is empty (shape {votes.shape})")
    if votes.dtype == bool or not np.issubdtype(votes.dtype, np.integer):
        raise ValueError(f"votes must be integer counts, got dtype {votes.dtype}")
    if np.any(votes < 0):
        raise ValueError("votes must be non-negative counts")
    if answered is None:
        mask = np.ones(votes.shape[0], dtype=bool)
    else:
        mask = np.asarray(answered)
        if mask.dtype != bool:
            raise ValueError(f"answered mask must be boolean, got dtype {mask.dtype}")
        if mask.shape != (votes.shape[0],):
            raise ValueError(f"answered mask must have shape ({votes.shape[0]},) to match the votes, got {mask.shape}")
    return votes.astype(np.int64), mask


def _param(mechanism: Any, name: str) -> float:
    value = getattr(mechanism, name, None)
    if value is None:
        raise ValueError(f"mechanism {mechanism.name!r} needs the parameter {name!r}")
    return float(value)


def query_costs(mechanism: Any, votes: np.ndarray, answered: np.ndarray | None = None, orders=None) -> QueryCosts:
    """Data-independent and data-dependent RDP of every query for LNMax / GNMax / Confident-GNMax.

    LNMax and GNMax pay for answered queries only; Confident-GNMax pays the threshold step
    on every query and GNMax(σ₂) on the answered ones.
    """
    votes, mask = validate_votes(votes, answered)
    orders = _as_orders(rdp_lib.DEFAULT_ORDERS if orders is None else orders)
    zeros = np.zeros((votes.shape[0], orders.size))
    if mechanism.name == "lnmax":
        scale = _param(mechanism, "laplace_scale")
        independent = np.where(mask[:, None], lnmax_rdp_data_independent(scale, orders), 0.0)
        dependent = np.where(mask[:, None], lnmax_rdp(lnmax_logq(votes, scale), scale, orders), 0.0)
    elif mechanism.name == "gnmax":
        sigma = _param(mechanism, "sigma")
        independent = np.where(mask[:, None], gnmax_rdp_data_independent(sigma, orders), 0.0)
        dependent = np.where(mask[:, None], gnmax_rdp(gnmax_logq(votes, sigma), sigma, orders), 0.0)
    elif mechanism.name == "confident-gnmax":
        sigma1, threshold, sigma2 = (_param(mechanism, n) for n in ("sigma1", "threshold", "sigma2"))
        independent = zeros + threshold_rdp_data_independent(sigma1, orders)
        independent += np.where(mask[:, None], gnmax_rdp_data_independent(sigma2, orders), 0.0)
        dependent = threshold_rdp(threshold_logq(votes, threshold, sigma1), sigma1, orders)
        dependent += np.where(mask[:, None], gnmax_rdp(gnmax_logq(votes, sigma2), sigma2, orders), 0.0)
    else:
        raise ValueError(f"no RDP analysis for mechanism {mechanism.name!r}")
    return QueryCosts(orders, independent, dependent, mask)


def _smooth_sensitivity_release(
    mechanism: Any,
    votes: np.ndarray,
    costs: QueryCosts,
    delta: float,
    conversion: str,
    rng: np.random.Generator,
    order: float | None,
    beta: float | None,
    sigma_ss: float | None,
) -> dict:
    """GNSS release of the data-dependent total (PATE 2018): the only publishable data-dependent ε."""
    from privacy.accounting import smooth_sensitivity as ss  # ss imports this module

    if mechanism.name not in ("gnmax", "confident-gnmax"):
        return {"available": False, "reason": "PATE 2018's smooth-sensitivity analysis covers GNMax and its threshold step only"}
    eps_by_order = [
        rdp_lib.epsilon_from_rdp([lam], [value], delta, conversion)[0]
        for lam, value in zip(costs.orders, costs.total_data_dependent)
    ]
    parameters_from_data = order is None or beta is None or sigma_ss is None
    num_teachers = int(votes.sum(axis=1).max())
    num_classes = votes.shape[1]
    sigma = _param(mechanism, "sigma2" if mechanism.name == "confident-gnmax" else "sigma")
    answered_votes = votes[costs.answered]

    def gnmax_status(lam: float) -> tuple[bool, tuple[bool, bool] | None]:
        """(GNMax's cost is the same for every histogram at λ, (C5, C6) or None when not needed)."""
        if num_classes < 2 or not answered_votes.shape[0]:
            return True, None
        unanimous = np.zeros((1, num_classes))
        unanimous[0, 0] = num_teachers
        try:
            # even a unanimous vote gets λ/σ²: the cost is constant and has no sensitivity
            if np.isclose(ss.gnmax_beta(gnmax_logq(unanimous, sigma), sigma, lam)[0], lam / sigma**2):
                return True, None
            return False, ss.check_conditions(sigma, num_classes, lam)
        except ArithmeticError:  # no crossing point q0 found: treat as failing conditions
            return False, (False, False)

    # As in the PATE 2018 analysis, release at the order where the data-dependent ε is
    # smallest — here the best one where the analysis is valid (C5 and C6 hold).
    candidates = [order] if order is not None else [float(costs.orders[i]) for i in np.argsort(eps_by_order)[:20]]
    for candidate in candidates:
        constant, conditions = gnmax_status(candidate)
        if constant or all(conditions):
            order = candidate
            break
    else:
        return {
            "available": False,
            "reason": f"conditions C5/C6 of PATE 2018 App. C fail for sigma={sigma}, k={num_classes} at the "
            f"order(s) tried ({', '.join(f'{c:g}' for c in candidates[:5])}{', ...' if len(candidates) > 5 else ''})",
        }
    value = 0.0
    ls_total = np.zeros(max(num_teachers, 1))
    if not constant:
        ls_total += ss.gnmax_local_sensitivity_by_distance(answered_votes, num_teachers, sigma, order).sum(axis=0)
    if answered_votes.shape[0]:
        value += float(ss.gnmax_beta(gnmax_logq(answered_votes, sigma), sigma, order).sum())
    if mechanism.name == "confident-gnmax":
        sigma1, threshold = _param(mechanism, "sigma1"), _param(mechanism, "threshold")
        ls_total += ss.threshold_local_sensitivity_by_distance(votes, num_teachers, threshold, sigma1, order).sum(axis=0)
        value += float(threshold_rdp(threshold_logq(votes, threshold, sigma1), sigma1, [order]).sum())
    if beta is not None and not 1 < order < 1 / (2 * beta):
        raise ValueError(f"smooth-sensitivity beta={beta} needs order < 1/(2 beta); got order {order}")
    released = ss.release(value, ls_total, order, rng, beta=beta, sigma_ss=sigma_ss)
    epsilon, _ = rdp_lib.epsilon_from_rdp([order], [released.released_rdp + released.gnss_rdp], delta, conversion)
    return {
        "available": True,
        "epsilon": epsilon,
        "order": released.order,
        "beta": released.beta,
        "sigma_ss": released.sigma_ss,
        "smooth_sensitivity": released.smooth_sensitivity,
        "noise_std": released.noise_std,
        "gnss_rdp": released.gnss_rdp,
        "released_rdp": released.released_rdp,
        "conditions": None if conditions is None else {"C5": conditions[0], "C6": conditions[1]},
        "parameters_from_data": parameters_from_data,
        "note": (
            "epsilon = (released data-dependent RDP + GNSS cost) at this order, converted to (eps, delta). "
            + (
                "Order/beta/sigma_ss were tuned on the votes as in the PATE 2018 analysis; fix them for a release "
                "whose parameters are public."
                if parameters_from_data
                else "Parameters were fixed by the caller."
            )
        ),
    }


def _nzc_report(mechanism: Any, mask: np.ndarray, delta: float, orders: np.ndarray) -> dict:
    """NZC as published: unbounded sound ε beside the paper's claim (Sun et al. 2019, Thm 4).

    The claim comes from the mechanism itself (``NZC.claimed_epsilon``) so every entry point
    prints the same figure, always next to the sound one.
    """
    answered = int(mask.sum())
    return {
        "sound": False,
        "reason": UNSOUND_REASON,
        "claimed": {
            "label": "the paper's claim, NOT a valid differential-privacy guarantee",
            "source": CLAIM_SOURCE,
            "epsilon_per_query": mechanism.claimed_epsilon(1, delta),
            "epsilon_total": mechanism.claimed_epsilon(answered, delta),
        },
        "rdp_data_independent": [math.inf] * orders.size,
        "rdp_data_dependent": [math.inf] * orders.size,
        "epsilon_data_independent": math.inf,
        "epsilon_data_dependent": math.inf,
        "order_data_independent": None,
        "order_data_dependent": None,
        "smooth_sensitivity": {"available": False, "reason": "no finite bound to release"},
        "epsilon_smooth_sensitivity": None,
    }


def _stability_report(mechanism: Any, orders: np.ndarray) -> dict:
    """Stability + sparse vector (Bassily, Thakkar, Thakurta 2018): its stated (ε, δ) for the whole run."""
    epsilon, mech_delta = mechanism.guarantee()
    curve = rdp_lib.pure_dp_rdp(orders, epsilon).tolist()
    return {
        "sound": True,
        "delta": mech_delta,
        "note": (
            "(epsilon, delta) of the sparse-vector stability mechanism (Bassily, Thakkar, Thakurta 2018) for the "
            "whole run of at most max_queries queries and max_unstable abstentions; its own delta, not the requested one"
        ),
        "rdp_data_independent": curve,
        "rdp_data_dependent": curve,
        "epsilon_data_independent": epsilon,
        "epsilon_data_dependent": epsilon,
        "order_data_independent": None,
        "order_data_dependent": None,
        "smooth_sensitivity": {"available": False, "reason": "the guarantee is data-independent"},
        "epsilon_smooth_sensitivity": None,
    }


def _mechanism_parameters(mechanism: Any) -> dict:
    names = ("laplace_scale", "sigma", "sigma1", "threshold", "sigma2", "constant", "epsilon", "delta", "max_unstable")
    return {n: getattr(mechanism, n) for n in names if getattr(mechanism, n, None) is not None}


def privacy_report(
    mechanism: Any,
    votes: np.ndarray,
    answered: np.ndarray | None,
    delta: float,
    orders=None,
    conversion: str = "tight",
    rng: np.random.Generator | None = None,
    ss_order: float | None = None,
    ss_beta: float | None = None,
    ss_sigma: float | None = None,
) -> dict:
    """The privacy report of answering ``votes`` with ``mechanism`` (same keys as ``conclave analyze --json``).

    Totals over the queries: ``rdp_data_independent`` / ``rdp_data_dependent`` (lists aligned
    with ``orders``) and their ε at ``delta`` with the ``conversion`` ("tight" as the ledger,
    "classic" as the PATE papers). ``epsilon_data_dependent`` depends on the private votes and
    must not be published; ``epsilon_smooth_sensitivity`` is its GNSS-privatized release
    (GNMax / Confident-GNMax; noise from ``rng``, OS entropy when None). NZC: ``sound`` false,
    infinite ε, and the paper's claim under ``claimed``. Stability: its own (ε, δ).

    Each call draws fresh release noise, i.e. is a new release with its own cost: compute the
    report of a run once and publish that one.
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if conversion not in rdp_lib.CONVERSIONS:
        raise ValueError(f"conversion must be one of {rdp_lib.CONVERSIONS}, got {conversion!r}")
    name = getattr(mechanism, "name", None)
    if name not in MECHANISMS:
        raise ValueError(f"unknown mechanism {name!r}; expected one of {', '.join(MECHANISMS)}")
    votes, mask = validate_votes(votes, answered)
    orders = _as_orders(rdp_lib.DEFAULT_ORDERS if orders is None else orders)
    report: dict[str, Any] = {
        "mechanism": name,
        "parameters": _mechanism_parameters(mechanism),
        "queries": int(votes.shape[0]),
        "answered": int(mask.sum()),
        "teachers": int(votes.sum(axis=1).max()),
        "classes": int(votes.shape[1]),
        "delta": float(delta),
        "conversion": conversion,
        "orders": orders.tolist(),
    }
    if name == "nzc":
        report.update(_nzc_report(mechanism, mask, delta, orders))
        return report
    if name == "stability":
        report.update(_stability_report(mechanism, orders))
        return report

    costs = query_costs(mechanism, votes, mask, orders)
    eps_ind, order_ind = rdp_lib.epsilon_from_rdp(orders, costs.total_data_independent, delta, conversion)
    eps_dep, order_dep = rdp_lib.epsilon_from_rdp(orders, costs.total_data_dependent, delta, conversion)
    release = _smooth_sensitivity_release(
        mechanism, votes, costs, delta, conversion, rng if rng is not None else make_rng(None), ss_order, ss_beta, ss_sigma
    )
    report.update(
        {
            "sound": True,
            "rdp_data_independent": costs.total_data_independent.tolist(),
            "rdp_data_dependent": costs.total_data_dependent.tolist(),
            "epsilon_data_independent": eps_ind,
            "order_data_independent": None if math.isnan(order_ind) else order_ind,
            "epsilon_data_dependent": eps_dep,
            "order_data_dependent": None if math.isnan(order_dep) else order_dep,
            "data_dependent_note": (
                "epsilon_data_dependent is computed from the private votes: do not publish it; publish "
                "epsilon_data_independent or the smooth-sensitivity release"
            ),
            "smooth_sensitivity": release,
            "epsilon_smooth_sensitivity": release.get("epsilon") if release.get("available") else None,
        }
    )
    return report
