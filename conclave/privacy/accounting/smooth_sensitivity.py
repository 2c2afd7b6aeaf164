"""Publishing a data-dependent privacy cost privately: smooth sensitivity and GNSS (PATE 2018).

The data-dependent RDP of GNMax / Confident-GNMax is a function of the private votes, so it
leaves only through the GNSS release, with parameters fixed before the votes are seen and a
charge of its own (``gnss_charge``). What it releases is still an estimate, never a guarantee.
Algorithms 3–5, conditions C5/C6 and Theorem 23: docs/privacy.md, "Smooth sensitivity and GNSS".
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special

from conclave.errors import InvalidValue
from conclave.privacy.accounting import pate
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.guarantee import Estimate
from conclave.privacy.accounting.rdp import epsilon_from_rdp
from conclave.privacy.noise import NoiseSource


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
    """PATE 2018 Algorithms 4–5: LS^(d) for d = 0 … num_teachers, one row per query.

    LS^(d)(x) bounds Algorithm 3's LS at every histogram within d moves of x (a move: one
    teacher's vote goes to another class). Under C5/C6, LS(q) rises with q below the plateau
    [q₁, q₀], is flat on it and falls above it, and no move jumps over it (u(q) < q₀ below q₁,
    l(q) > q₁ above q₀). So LS^(d) is LS at the ball's extreme q, or the plateau's value (the
    global maximum) once the ball reaches the plateau. The extreme q is reached by a walk
    between the top two classes (a histogram in the ball led by another class has a twin with
    those two counts swapped, no farther from x and with the same q, led by x's top class):

    - below q₁, the largest q: d votes from the top class to the second. A move from the top
      lowers every gap by 1 and the receiver's by one more; the normal tail is convex on
      [0, ∞), so the extra reductions are worth most concentrated on the smallest gap. Once
      the top two are within one vote, q ≥ Pr[N(0, 2σ²) ≥ 1] > e^{−(1+1/σ)²} ≥ q₀: the
      plateau has been reached;
    - above q₀, the smallest q: one vote at a time from the current second class to the top,
      the greedy optimum of a separable convex function of the gaps for a fixed number of
      moves (Federgruen & Groenevelt 1986).

    d = num_teachers reaches every histogram, so the last entry is the global maximum and
    holds for every larger d. The running maximum keeps the sequence non-decreasing in
    floating point too, as a maximum over growing balls must be.
    """
    votes = np.asarray(votes, dtype=float)
    queries, num_classes = votes.shape
    if np.any(votes.sum(axis=1) > num_teachers):
        raise InvalidValue(f"vote histograms count more than num_teachers={num_teachers} votes")
    if num_classes < 2:
        return np.zeros((queries, num_teachers + 1))
    logq0 = gnmax_logq0(sigma, order)
    logq1 = float(np.log(gnmax_q_lower(math.exp(logq0), sigma, num_classes)))
    plateau = float(gnmax_local_sensitivity(np.array([logq1]), sigma, num_classes, order)[0])
    result = np.full((queries, num_teachers + 1), plateau)

    current = -np.sort(-votes, axis=1)
    logq = pate.gnmax_logq(current, sigma)
    go_left = logq > logq0
    active = go_left | (logq < logq1)
    result[active, 0] = gnmax_local_sensitivity(logq[active], sigma, num_classes, order)
    for distance in range(1, num_teachers + 1):
        active &= np.where(go_left, (logq > logq0) & (current[:, 1] > 0), logq < logq1)
        if not np.any(active):
            break
        step = np.where(go_left, 1.0, -1.0)[active]
        current[active, 0] += step
        current[active, 1] -= step
        current[active] = -np.sort(-current[active], axis=1)
        logq[active] = pate.gnmax_logq(current[active], sigma)
        result[active, distance] = gnmax_local_sensitivity(logq[active], sigma, num_classes, order)
    return np.maximum.accumulate(result, axis=1)


def threshold_local_sensitivity_by_distance(
    votes: np.ndarray, num_teachers: int, threshold: float, sigma1: float, order: float
) -> np.ndarray:
    """LS^(d) of the threshold step's cost for d = 0 … num_teachers, one row per query (PATE 2018 App. C).

    The cost depends on m = max_j n_j only, and one move changes m by at most 1, so the
    histograms within d moves have their maximum in [m − d, m + d] ∩ [0, num_teachers], and
    LS^(d) is the largest one-step change of the tabulated cost from any m' in that interval.
    The change at exactly m ± d alone (as in the reference code) is not a maximum over the
    ball: it falls again past the cost's steepest point, and a sum of such sequences over
    queries is not β-smooth.
    """
    maxima = np.arange(num_teachers + 1, dtype=float)
    logq = pate.threshold_logq(np.stack([maxima, np.zeros_like(maxima)], axis=1), threshold, sigma1)
    costs = pate.threshold_rdp(logq, sigma1, [order])[:, 0]
    steps = np.abs(np.diff(costs))  # steps[v] = |cost(v+1) − cost(v)|
    step_at = np.zeros(num_teachers + 1)  # largest one-step change from m
    step_at[:-1] = steps
    step_at[1:] = np.maximum(step_at[1:], steps)

    current = np.rint(np.asarray(votes, dtype=float).max(axis=1)).astype(int)
    if np.any(current > num_teachers):
        raise InvalidValue(f"a vote count exceeds num_teachers={num_teachers}")
    distances = np.arange(num_teachers + 1)
    up = current[:, None] + distances[None, :]
    down = current[:, None] - distances[None, :]
    exactly_d_away = np.maximum(
        np.where(up <= num_teachers, step_at[np.clip(up, 0, num_teachers)], 0.0),
        np.where(down >= 0, step_at[np.clip(down, 0, num_teachers)], 0.0),
    )
    return np.maximum.accumulate(exactly_d_away, axis=1)  # every m' within d


def smooth_sensitivity(ls_by_distance: np.ndarray, beta: float) -> float:
    """β-smooth sensitivity from local sensitivities at distance d: max_d e^(−βd)·LS^(d).

    The last entry holds for every larger d (the ball then covers every histogram), where
    e^(−βd) only shrinks, so the maximum over the array is the maximum over all d.
    """
    ls_by_distance = np.asarray(ls_by_distance, dtype=float)
    return float(np.max(ls_by_distance * np.exp(-beta * np.arange(ls_by_distance.size)))) if ls_by_distance.size else 0.0


def gnss_rdp(beta: float, sigma_ss: float, order: float) -> float:
    """PATE 2018 Theorem 23: RDP at λ of releasing f + SS_β·N(0, σ_ss²), valid for 1 < λ < 1/(2β)."""
    if beta <= 0 or not 1 < order < 1 / (2 * beta):
        raise InvalidValue(f"GNSS needs beta > 0 and 1 < order < 1/(2 beta); got beta={beta}, order={order}")
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
# what a mechanism contributes: the cost at one order and its local sensitivities


@dataclass(frozen=True)
class SmoothTerms:
    """A run's data-dependent RDP at one order and its LS^(d) (both private), and whether the
    analysis is valid (C5/C6, which depend on public parameters only).

    ``ls_by_distance[d]`` is LS^(d) for d = 0 … D: non-decreasing (a maximum over growing
    balls), its last entry holding for every d ≥ D.
    """

    value: float
    ls_by_distance: np.ndarray
    valid: bool = True
    reason: str = ""

    def __post_init__(self) -> None:
        ls = np.asarray(self.ls_by_distance)
        if ls.ndim != 1 or not ls.size or np.any(np.diff(ls) < 0):
            raise InvalidValue("ls_by_distance must be a non-empty, non-decreasing 1-d array: LS^(d) is a "
                             "maximum over the histograms within distance d")

    def __add__(self, other: SmoothTerms) -> SmoothTerms:
        size = max(self.ls_by_distance.size, other.ls_by_distance.size)
        # a sequence's last entry holds for every larger d: extend it, not zeros
        ls = (np.pad(self.ls_by_distance, (0, size - self.ls_by_distance.size), mode="edge")
              + np.pad(other.ls_by_distance, (0, size - other.ls_by_distance.size), mode="edge"))
        return SmoothTerms(self.value + other.value, ls, self.valid and other.valid,
                           "; ".join(r for r in (self.reason, other.reason) if r))


def gnmax_terms(answered_votes: np.ndarray, sigma: float, order: float, num_teachers: int,
                num_classes: int) -> SmoothTerms:
    """GNMax's part: β summed over the answered queries and its LS^(d) (Algorithms 3–5)."""
    answered_votes = np.asarray(answered_votes, dtype=float)
    nothing = np.zeros(num_teachers + 1)
    if num_classes < 2 or not answered_votes.shape[0]:
        return SmoothTerms(0.0, nothing)
    try:
        unanimous = np.zeros((1, num_classes))
        unanimous[0, 0] = num_teachers
        if np.isclose(gnmax_beta(pate.gnmax_logq(unanimous, sigma), sigma, order)[0], order / sigma**2):
            # even a unanimous vote costs λ/σ²: the cost is the same for every histogram
            return SmoothTerms(answered_votes.shape[0] * order / sigma**2, nothing)
        c5, c6 = check_conditions(sigma, num_classes, order)
    except ArithmeticError:  # no crossing point q0: the analysis does not apply
        c5 = c6 = False
    if not (c5 and c6):
        return SmoothTerms(math.nan, nothing, valid=False,
                           reason=f"conditions C5/C6 of PATE 2018 App. C fail for sigma={sigma:g}, "
                                  f"k={num_classes} at order {order:g}")
    value = float(gnmax_beta(pate.gnmax_logq(answered_votes, sigma), sigma, order).sum())
    ls = gnmax_local_sensitivity_by_distance(answered_votes, num_teachers, sigma, order).sum(axis=0)
    return SmoothTerms(value, ls)


def threshold_terms(votes: np.ndarray, threshold: float, sigma1: float, order: float,
                    num_teachers: int) -> SmoothTerms:
    """Confident-GNMax's threshold step: its cost on every query and the exact LS^(d)."""
    value = float(pate.threshold_rdp(pate.threshold_logq(votes, threshold, sigma1), sigma1, [order]).sum())
    ls = threshold_local_sensitivity_by_distance(votes, num_teachers, threshold, sigma1, order).sum(axis=0)
    return SmoothTerms(value, ls)


# ---------------------------------------------------------------------------------------
# the release, with parameters fixed in advance


@dataclass(frozen=True)
class SmoothSensitivityParameters:
    """(order λ, β, σ_ss) of a GNSS release, fixed before the votes are seen."""

    order: float
    beta: float
    sigma_ss: float

    def __post_init__(self) -> None:
        if not (self.beta > 0 and 1 < self.order < 1 / (2 * self.beta)):
            raise InvalidValue(f"smooth sensitivity needs beta > 0 and 1 < order < 1/(2 beta); got order "
                             f"{self.order}, beta {self.beta}")
        if not self.sigma_ss > 0:
            raise InvalidValue(f"sigma_ss must be > 0, got {self.sigma_ss}")

    @classmethod
    def for_workload(cls, planned: PrivacyCharge, delta: float, share: float = 0.05) -> SmoothSensitivityParameters:
        """Public defaults from the planned worst-case workload (nothing private is read).

        order: data-dependent costs of confident ensembles are a fraction of the worst case,
        which moves the best order up; 1 + 2(λ_w − 1), λ_w the worst case's best order, is the
        best order of a workload a quarter of the worst case (for linear RDP curves λ* − 1 ∝
        1/sqrt(cost)). β = 0.4/λ (inside PATE 2018's range [0.3, 0.5)/λ). σ_ss makes the
        release's main cost term λe^{2β}/σ_ss² a ``share`` of the worst case at that order.
        """
        _, worst_order = epsilon_from_rdp(planned.orders, planned.rdp, delta - planned.extra_delta)
        order = 1 + 2 * (worst_order - 1)
        beta = 0.4 / order
        worst_at_order = float(np.interp(order, planned.orders, planned.rdp))
        sigma_ss = math.sqrt(order * math.exp(2 * beta) / (share * worst_at_order))
        return cls(float(order), float(beta), float(sigma_ss))

    def charge(self, orders: np.ndarray) -> PrivacyCharge:
        """The release's own cost on a grid (PATE 2018, Thm 23 at every order below 1/(2β); none above)."""
        rdp = np.array([gnss_rdp(self.beta, self.sigma_ss, lam) if lam < 1 / (2 * self.beta) else math.inf
                        for lam in orders])
        return PrivacyCharge(orders, rdp, label="smooth-sensitivity-release", neighbouring=Neighbouring.ONE_VOTE,
                             details={"order": self.order, "beta": self.beta, "sigma_ss": self.sigma_ss})


def release_estimate(terms: SmoothTerms, params: SmoothSensitivityParameters, delta: float, conversion: str,
                     noise: NoiseSource) -> Estimate:
    """Release the data-dependent cost ``terms.value`` with GNSS and turn it into an estimate of ε.

    ε = (released RDP + the release's own cost) at ``params.order``, converted at δ. The
    estimate carries the public parameters and the released value, nothing derived from the
    private smooth sensitivity. Charge ``params.charge(...)`` to the ledger before calling.
    """
    source = "PATE 2018, App. C: smooth-sensitivity (GNSS) release of the data-dependent cost"
    if not terms.valid:
        return Estimate("smooth-sensitivity", None, delta, source, details={"available": False, "reason": terms.reason})
    ss = smooth_sensitivity(terms.ls_by_distance, params.beta)
    # A cost that is the same for every histogram (ss = 0) reveals nothing: released as is.
    noisy = terms.value if ss <= 0 else float(noise.gaussian(np.array([terms.value]), ss * params.sigma_ss)[0])
    released = max(0.0, noisy)  # post-processing
    cost = gnss_rdp(params.beta, params.sigma_ss, params.order)
    epsilon, _ = epsilon_from_rdp([params.order], [released + cost], delta, conversion)
    return Estimate("smooth-sensitivity", epsilon, delta, source, details={
        "available": True, "order": params.order, "beta": params.beta, "sigma_ss": params.sigma_ss,
        "released_rdp": released, "release_rdp_cost": cost, "conversion": conversion,
        "parameters": "fixed before the votes were seen"})
