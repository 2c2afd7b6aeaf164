"""Publishing a data-dependent privacy cost privately: smooth sensitivity and GNSS (PATE 2018).

The data-dependent RDP of GNMax / Confident-GNMax is a function of the private votes, so it
may only leave through a DP mechanism. Papernot et al. 2018 (§4 and App. C, "Smooth
sensitivity analysis") bound how much that cost can move between neighbouring vote
histograms (one teacher changes its vote) and release it with the Gaussian noise with
smooth sensitivity mechanism (GNSS):

- local sensitivity of one GNMax answer's cost at q: Algorithm 3 / Proposition 13,
  LS(q) = max(β(u(q)) − β(q), β(q) − β(l(q))), with u/l the largest/smallest q bound of a
  neighbour and β the Theorem 6 bound switched to λ/σ² at the crossing point q₀ (the
  plateau [q₁, q₀] with q₁ = l(q₀) takes the value at q₁);
- local sensitivity at distance d (Algorithms 4–5): the largest LS among histograms
  reachable by moving d votes; for the threshold step the cost depends on max_j n_j only,
  so every reachable value is enumerated;
- smooth sensitivity SS_β = max_d e^(−βd)·LS^(d), summed over queries (each query's cost
  moves at most its own LS^(d), so the total moves at most the sum);
- GNSS release: value + SS_β·N(0, σ_ss²) is (λ, λe^(2β)/σ_ss² + (βλ − ½log(1 − 2βλ))/(λ−1))-RDP
  for 1 < λ < 1/(2β) (PATE 2018, Theorem 23).

Algorithm 3's bound is correct when conditions C5 (β non-decreasing on (0, q₀)) and C6
(β(u(q)) − β(q) non-decreasing on (0, l(q₀))) hold; ``check_conditions`` verifies both
numerically on dense grids and the release is refused when they fail.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special

from privacy.accounting import pate


# ---------------------------------------------------------------------------------------
# β(q) for the smooth-sensitivity analysis of GNMax at one order


@functools.lru_cache(maxsize=256)
def gnmax_logq0(sigma: float, order: float) -> float:
    """log q₀: where Theorem 6 meets the data-independent λ/σ² (below it, Theorem 6 is smaller).

    Found by bracketing from a point where Prop 10's conditions surely hold
    (μ₂ ≥ σ + 1, μ₁ ≥ λ + 0.01) and solving with Brent's method.
    """
    def gap(logq: float) -> float:
        return float(pate.gnmax_theorem6(logq, sigma, [order])[0, 0] - order / sigma**2)

    upper = min(-((1 + 1 / sigma) ** 2), -(((order - 0.99) / sigma) ** 2), -1 / sigma**2)
    if not pate.gnmax_theorem6_applies(upper, sigma, [order])[0, 0]:
        raise ArithmeticError(f"Prop 10 conditions fail at the bracket for sigma={sigma}, order={order}")
    if gap(upper) < 0:
        return upper
    lower = 2 * upper
    while gap(lower) > 0:
        lower *= 1.5
        if lower < -1e5:
            raise ArithmeticError(f"no crossing point q0 for sigma={sigma}, order={order}")
    return float(optimize.brentq(gap, lower, upper, xtol=1e-12, rtol=1e-14))


def gnmax_q_upper(q: np.ndarray, sigma: float, num_classes: int) -> np.ndarray:
    """u(q): the largest Prop 7 bound a neighbour can have, (k−1)/2·erfc(erfc⁻¹(2q/(k−1)) − 1/σ), ≤ 1.

    Each gap moves by at most 2, i.e. each erfc argument by 1/σ; with the sum fixed the
    extreme is reached with equal terms (PATE 2018, App. C).
    """
    m = num_classes - 1
    return np.minimum(1.0, m / 2 * special.erfc(special.erfcinv(2 * np.asarray(q) / m) - 1 / sigma))


def gnmax_q_lower(q: np.ndarray, sigma: float, num_classes: int) -> np.ndarray:
    """l(q): the smallest Prop 7 bound a neighbour can have, (k−1)/2·erfc(erfc⁻¹(2q/(k−1)) + 1/σ)."""
    m = num_classes - 1
    return m / 2 * special.erfc(special.erfcinv(2 * np.asarray(q) / m) + 1 / sigma)


def gnmax_beta(logq: np.ndarray, sigma: float, order: float) -> np.ndarray:
    """β(q): Theorem 6 below q₀, λ/σ² from q₀ on, 0 at q = 0 — the cost whose sensitivity is analysed.

    Equals ``pate.gnmax_rdp`` wherever C5 holds (tested), so the value released is the one reported.
    """
    logq = np.asarray(logq, dtype=float)
    flat = logq.reshape(-1)
    out = np.full(flat.shape, order / sigma**2)
    below = flat < gnmax_logq0(sigma, order)
    dependent = below & np.isfinite(flat)
    if np.any(dependent):
        out[dependent] = pate.gnmax_theorem6(flat[dependent], sigma, [order])[:, 0]
    out[np.isneginf(flat)] = 0.0
    return out.reshape(logq.shape)


def _safe_log(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(x)


def gnmax_local_sensitivity(logq: np.ndarray, sigma: float, num_classes: int, order: float) -> np.ndarray:
    """PATE 2018 Algorithm 3: upper bound on the local sensitivity of β at a histogram with bound q."""
    logq = np.asarray(logq, dtype=float)
    if num_classes < 2:
        return np.zeros_like(logq)
    logq0 = gnmax_logq0(sigma, order)
    logq1 = float(np.log(gnmax_q_lower(math.exp(logq0), sigma, num_classes)))
    on_plateau = (logq >= logq1) & (logq <= logq0)
    logq = np.where(on_plateau, logq1, logq)
    q = np.exp(logq)
    beta = gnmax_beta(logq, sigma, order)
    beta_up = gnmax_beta(_safe_log(gnmax_q_upper(q, sigma, num_classes)), sigma, order)
    beta_low = gnmax_beta(_safe_log(gnmax_q_lower(q, sigma, num_classes)), sigma, order)
    result = np.maximum(beta_up - beta, beta - beta_low)
    # On the plateau a neighbour may reach q ≥ q₀, where β = λ/σ². When Theorem 6 is already
    # below λ/σ² at the bracket (small σ), β jumps at q₀ and u(q₁) lands a rounding error
    # short of q₀, so Algorithm 3 alone would miss the jump: add λ/σ² − β(q₁) explicitly.
    jump = order / sigma**2 - float(gnmax_beta(np.array([logq1]), sigma, order)[0])
    return np.where(on_plateau, np.maximum(result, jump), result)


def gnmax_local_sensitivity_by_distance(votes: np.ndarray, num_teachers: int, sigma: float, order: float) -> np.ndarray:
    """PATE 2018 Algorithms 4–5: LS^(d) for d = 0 … num_teachers−1, one row per query.

    From a histogram outside the plateau [q₁, q₀] the worst neighbour within distance d is
    reached by moving votes between the top two classes, towards the plateau (to the second
    class when q < q₁, to the top class when q > q₀); once the plateau is reached (or the
    walk ends) the plateau's value, the global maximum of LS, is used.
    """
    votes = np.asarray(votes, dtype=float)
    queries, num_classes = votes.shape
    if num_classes < 2:
        return np.zeros((queries, num_teachers))
    logq0 = gnmax_logq0(sigma, order)
    logq1 = float(np.log(gnmax_q_lower(math.exp(logq0), sigma, num_classes)))
    plateau = float(gnmax_local_sensitivity(np.array([logq1]), sigma, num_classes, order)[0])
    result = np.full((queries, num_teachers), plateau)

    current = -np.sort(-votes, axis=1)
    logq = pate.gnmax_logq(current, sigma)
    go_left = logq > logq0
    active = go_left | (logq < logq1)
    result[active, 0] = gnmax_local_sensitivity(logq[active], sigma, num_classes, order)
    for distance in range(1, num_teachers):
        active &= np.where(go_left, (logq > logq0) & (current[:, 1] > 0), logq < logq1)
        if not np.any(active):
            break
        step = np.where(go_left, 1.0, -1.0)[active]
        current[active, 0] += step
        current[active, 1] -= step
        current[active] = -np.sort(-current[active], axis=1)
        logq[active] = pate.gnmax_logq(current[active], sigma)
        result[active, distance] = gnmax_local_sensitivity(logq[active], sigma, num_classes, order)
    return result


def threshold_local_sensitivity_by_distance(
    votes: np.ndarray, num_teachers: int, threshold: float, sigma1: float, order: float
) -> np.ndarray:
    """LS^(d) of the threshold step's cost, one row per query (PATE 2018 App. C).

    The cost depends on m = max_j n_j only, and one teacher moves m by at most 1, so the
    cost at every m in 0…num_teachers is tabulated and LS^(d) is the largest one-step change
    at m ± d.
    """
    maxima = np.arange(num_teachers + 1, dtype=float)
    logq = pate.threshold_logq(np.stack([maxima, np.zeros_like(maxima)], axis=1), threshold, sigma1)
    costs = pate.threshold_rdp(logq, sigma1, [order])[:, 0]
    steps = np.abs(np.diff(costs))  # steps[v] = |cost(v+1) − cost(v)|
    step_at = np.zeros(num_teachers + 1)  # largest one-step change from m
    step_at[:-1] = steps
    step_at[1:] = np.maximum(step_at[1:], steps)

    current = np.rint(np.asarray(votes, dtype=float).max(axis=1)).astype(int)
    distances = np.arange(num_teachers)
    up = current[:, None] + distances[None, :]
    down = current[:, None] - distances[None, :]
    result = np.maximum(
        np.where(up <= num_teachers, step_at[np.clip(up, 0, num_teachers)], 0.0),
        np.where(down >= 0, step_at[np.clip(down, 0, num_teachers)], 0.0),
    )
    return result


def smooth_sensitivity(ls_by_distance: np.ndarray, beta: float) -> float:
    """β-smooth sensitivity from local sensitivities at distance d: max_d e^(−βd)·LS^(d)."""
    ls_by_distance = np.asarray(ls_by_distance, dtype=float)
    return float(np.max(ls_by_distance * np.exp(-beta * np.arange(ls_by_distance.size)))) if ls_by_distance.size else 0.0


def gnss_rdp(beta: float, sigma_ss: float, order: float) -> float:
    """PATE 2018 Theorem 23: RDP at λ of releasing f + SS_β·N(0, σ_ss²), valid for 1 < λ < 1/(2β)."""
    if beta <= 0 or not 1 < order < 1 / (2 * beta):
        raise ValueError(f"GNSS needs beta > 0 and 1 < order < 1/(2 beta); got beta={beta}, order={order}")
    if math.isinf(sigma_ss):
        return 0.0
    return order * math.exp(2 * beta) / sigma_ss**2 + (beta * order - 0.5 * math.log1p(-2 * order * beta)) / (order - 1)


# ---------------------------------------------------------------------------------------
# conditions C5, C6


def check_conditions(sigma: float, num_classes: int, order: float, points: int = 4000) -> tuple[bool, bool]:
    """(C5, C6) of PATE 2018 App. C, checked numerically on dense grids of q.

    C5: Theorem 6's β(q) is non-decreasing on (0, q₀).
    C6: β(u(q)) − β(q) (Theorem 6 expression) is non-decreasing on (0, l(q₀)).
    The grids are log-spaced towards q → 0 and linear near the upper end, where the
    functions bend; a decrease larger than rounding noise anywhere fails the condition.
    """
    logq0 = gnmax_logq0(sigma, order)
    q0 = math.exp(logq0)

    def grid(upper_log: float) -> np.ndarray:
        # down to q ≈ e^-700, the smallest q whose neighbour bounds are still representable
        logs = -np.geomspace(max(min(-200 * upper_log, 700.0), -upper_log), -upper_log, points)
        linear = np.log(np.linspace(math.exp(upper_log) * 1e-3, math.exp(upper_log), points))
        return np.unique(np.concatenate([logs, linear]))

    def non_decreasing(values: np.ndarray) -> bool:
        tolerance = 1e-9 * max(1.0, float(np.max(np.abs(values))))
        return bool(np.all(np.diff(values) >= -tolerance))

    def theorem6(logq: np.ndarray) -> np.ndarray:
        return pate.gnmax_theorem6(logq, sigma, [order])[:, 0]

    logq = grid(logq0)
    cond5 = non_decreasing(theorem6(logq))
    if not cond5:
        return False, False
    upper = math.log(gnmax_q_lower(q0, sigma, num_classes))
    logq = grid(upper)
    q_up = np.log(gnmax_q_upper(np.exp(logq), sigma, num_classes))
    cond6 = non_decreasing(theorem6(q_up) - theorem6(logq))
    return cond5, cond6


# ---------------------------------------------------------------------------------------
# the release


@dataclass(frozen=True)
class SmoothSensitivityRelease:
    """One GNSS release of a data-dependent RDP total at ``order``.

    ``released_rdp`` and ``epsilon`` are the publishable figures; ``epsilon`` converts
    released_rdp + the GNSS cost at ``order`` to (ε, δ). ``noise_std`` = SS_β·σ_ss.
    """

    order: float
    beta: float
    sigma_ss: float
    smooth_sensitivity: float
    noise_std: float
    gnss_rdp: float
    released_rdp: float


def optimal_parameters(rdp_value: float, ls_by_distance: np.ndarray, order: float) -> tuple[float, float, float]:
    """(β, σ_ss, SS_β) minimising value + GNSS cost + two noise std's (the PATE 2018 analysis).

    β ranges over [0.3/λ, 0.495/λ) so that λ < 1/(2β); for each β the optimal σ_ss of
    λe^(2β)/σ² + 2·SS·σ is (λe^(2β)/SS)^(1/3). These choices look at the private votes;
    pass fixed parameters to ``release`` for a release whose parameters are public.
    """
    best: tuple[float, float, float, float] | None = None
    for beta in np.arange(0.3, 0.495, 0.01) / order:
        ss = smooth_sensitivity(ls_by_distance, beta)
        if ss <= 0:
            return float(beta), math.inf, 0.0
        sigma_ss = (order * math.exp(2 * beta) / ss) ** (1 / 3)
        cost = rdp_value + gnss_rdp(beta, sigma_ss, order) + 2 * ss * sigma_ss
        if best is None or cost < best[0]:
            best = (cost, float(beta), sigma_ss, ss)
    assert best is not None
    return best[1], best[2], best[3]


def release(
    rdp_value: float,
    ls_by_distance: np.ndarray,
    order: float,
    rng: np.random.Generator,
    beta: float | None = None,
    sigma_ss: float | None = None,
) -> SmoothSensitivityRelease:
    """Release ``rdp_value`` (a data-dependent RDP total at ``order``) with GNSS.

    ``ls_by_distance`` is the total's LS^(d). Without ``beta``/``sigma_ss`` they are
    chosen by ``optimal_parameters``. The released value is clipped at 0 (post-processing).
    """
    if beta is None or sigma_ss is None:
        beta, sigma_ss, ss = optimal_parameters(rdp_value, ls_by_distance, order)
    else:
        ss = smooth_sensitivity(ls_by_distance, beta)
    if ss <= 0:
        # the cost is the same for every histogram: publishing it reveals nothing
        sigma_ss = math.inf
        noise_std = 0.0
    else:
        noise_std = ss * sigma_ss
    noise = float(rng.normal(0.0, noise_std)) if noise_std > 0 else 0.0
    return SmoothSensitivityRelease(
        order=float(order),
        beta=float(beta),
        sigma_ss=float(sigma_ss),
        smooth_sensitivity=float(ss),
        noise_std=float(noise_std),
        gnss_rdp=gnss_rdp(beta, sigma_ss, order),
        released_rdp=max(0.0, rdp_value + noise),
    )
