"""RDP of secure sums with distributed Skellam noise, full-batch and Poisson-subsampled (DP-SGD).

Each owner quantizes its vector to integers and adds a share Poisson(μ/2n) − Poisson(μ/2n) to
every coordinate; the shares of n owners sum to the Skellam noise Sk(μ) = Poisson(μ/2) −
Poisson(μ/2), of **variance μ** per coordinate (Agarwal, Kairouz & Liu, "The Skellam mechanism for
differentially private federated learning", NeurIPS 2021, arXiv 2110.04995; their Sk_{0,μ}, pmf
e^{−μ}·I_k(μ)). The curves here take μ as the variance that reaches the sum in the worst case: if
fewer shares can arrive (dropouts), the caller charges the smaller total.

Orders. Both theorems used here hold at integer orders α ≥ 2. At other orders the curve is
interpolated with a sound rule: (α − 1)·D_α(P‖Q) = log E_Q[(dP/dQ)^α] is convex in α (Hölder's
inequality; Van Erven & Harremoës 2014, "Rényi divergence and Kullback–Leibler divergence", §III)
and 0 at α = 1. So for n < α < n + 1, with t = α − n,

    (α − 1)·ε(α) ≤ (1 − t)·(n − 1)·ε(n) + t·n·ε(n + 1),

for every pair of neighbours, hence for the supremum; between 1 and 2 this gives ε(α) ≤ ε(2).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from scipy import special

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.rdp import _orders

# Integer orders → RDP bound at those orders (each ≥ 2).
IntegerRdp = Callable[[np.ndarray], np.ndarray]


def skellam_rdp(orders, l1_sensitivity: float, l2_sensitivity: float, variance: float) -> np.ndarray:
    """RDP of the multi-dimensional Skellam mechanism: integer vector + Sk(μ) on every coordinate.

    Agarwal, Kairouz & Liu 2021, Corollary 3.6 (arXiv 2110.04995v2; the multi-dimensional form
    of their one-dimensional bound on D_α(Sk_{Δ,μ} ‖ Sk_{0,μ})): for integer α > 1 and neighbours
    whose integer vectors differ by v with ‖v‖₁ ≤ Δ₁, ‖v‖₂ ≤ Δ₂,

        ε(α) = α·Δ₂²/(2μ) + min( ((2α − 1)·Δ₂² + 6·Δ₁)/(4μ²),  3·Δ₁/(2μ) ),

    μ the variance of the noise on each coordinate. The first term is the Gaussian mechanism's
    α·Δ₂²/(2σ²) at σ² = μ; the second is the price of discreteness and vanishes as μ grows.
    The bound increases with Δ₁ and Δ₂, so real-valued upper bounds on the norms are fine.
    Non-integer orders are interpolated as in the module docstring.
    """
    l1, l2, mu = _check_skellam(l1_sensitivity, l2_sensitivity, variance)
    return at_integer_orders(_orders(orders), skellam_integer_rdp(l1, l2, mu))


def poisson_subsampled_rdp(orders, sample_rate: float, base: IntegerRdp) -> np.ndarray:
    """RDP of M∘PoissonSample(q) under add/remove, for any M whose RDP at integer orders is ``base``.

    Zhu & Wang, "Poisson subsampled Rényi differential privacy" (ICML 2019), Theorem 6 (the
    general upper bound, no assumption on M): for integer α ≥ 2,

        ε'(α) ≤ 1/(α − 1) · log( (1 − q)^{α−1}·(1 + (α − 1)q)
                                 + C(α, 2)·q²·(1 − q)^{α−2}·e^{ε(2)}
                                 + 3·Σ_{l=3..α} C(α, l)·q^l·(1 − q)^{α−l}·e^{(l−1)·ε(l)} ),

    ε the base's RDP. Subsampling never costs more than the mechanism itself (∫p^α·q^{1−α} is
    jointly convex in (p, q) for α > 1, so mixing in the record's absence only lowers it), so
    the curve is the smaller of the two at each integer order, interpolated in between as in
    the module docstring.
    At q = 1 it is the base; at q = 0 it is zero.
    """
    lam = _orders(orders)
    if not 0 <= sample_rate <= 1:
        raise InvalidValue(f"sample_rate must be in [0, 1], got {sample_rate}")
    if sample_rate == 0:
        return np.zeros_like(lam)
    if sample_rate == 1:
        return at_integer_orders(lam, base)
    return at_integer_orders(lam, _zhu_wang(sample_rate, base))


def subsampled_skellam_rdp(
    orders, sample_rate: float, l1_sensitivity: float, l2_sensitivity: float, variance: float, steps: int
) -> np.ndarray:
    """RDP of ``steps`` Poisson-subsampled Skellam sums (DP-SGD over secure aggregation).

    Each step samples every record with probability q and releases the Skellam-noised sum of the
    sampled records' quantized clipped gradients: ``poisson_subsampled_rdp`` (Zhu & Wang 2019,
    Thm. 6) of ``skellam_rdp`` (Agarwal et al. 2021, Cor. 3.6), composed over the steps
    (Mironov 2017, Prop. 1).
    """
    lam = _orders(orders)
    l1, l2, mu = _check_skellam(l1_sensitivity, l2_sensitivity, variance)
    if steps < 0:
        raise InvalidValue(f"steps must be >= 0, got {steps}")
    return steps * poisson_subsampled_rdp(lam, sample_rate, skellam_integer_rdp(l1, l2, mu))  # always finite


# --- charge builders ----------------------------------------------------------------------


def skellam_charge(l1_sensitivity: float, l2_sensitivity: float, variance: float, count: int = 1, label: str = "",
                   orders=None, neighbouring: Neighbouring = Neighbouring.ADD_REMOVE) -> PrivacyCharge:
    """``count`` full-batch secure sums with Skellam noise (DP-PCA covariances, counts)."""
    if count < 0:
        raise InvalidValue(f"count must be >= 0, got {count}")
    lam = _orders(orders)
    return PrivacyCharge(
        lam,
        count * skellam_rdp(lam, l1_sensitivity, l2_sensitivity, variance),
        label=label,
        details={"l1_sensitivity": l1_sensitivity, "l2_sensitivity": l2_sensitivity, "variance": variance,
                 "count": count},
        neighbouring=neighbouring,
    )


def subsampled_skellam_charge(
    sample_rate: float, l1_sensitivity: float, l2_sensitivity: float, variance: float, steps: int,
    label: str = "", orders=None,
) -> PrivacyCharge:
    """``steps`` DP-SGD steps over secure aggregation (Poisson rate q); see subsampled_skellam_rdp."""
    lam = _orders(orders)
    return PrivacyCharge(
        lam,
        subsampled_skellam_rdp(lam, sample_rate, l1_sensitivity, l2_sensitivity, variance, steps),
        label=label,
        details={"sample_rate": sample_rate, "l1_sensitivity": l1_sensitivity, "l2_sensitivity": l2_sensitivity,
                 "variance": variance, "steps": steps},
        neighbouring=Neighbouring.ADD_REMOVE,  # Poisson-sampling amplification is an add/remove statement
    )


# --- internals ----------------------------------------------------------------------------


def _check_skellam(l1: float, l2: float, variance: float) -> tuple[float, float, float]:
    if not variance > 0 or not math.isfinite(variance):
        raise InvalidValue(f"variance must be a finite number > 0, got {variance}")
    if not l2 >= 0 or not math.isfinite(l2):
        raise InvalidValue(f"l2_sensitivity must be a finite number >= 0, got {l2}")
    if not l1 >= l2 or not math.isfinite(l1):  # ‖v‖₁ ≥ ‖v‖₂ for every vector: catches swapped arguments
        raise InvalidValue(f"l1_sensitivity must be finite and >= l2_sensitivity ({l2}), got {l1}")
    return float(l1), float(l2), float(variance)


def skellam_integer_rdp(l1: float, l2: float, mu: float) -> IntegerRdp:
    """Agarwal et al. 2021, Cor. 3.6 at integer orders ≥ 2."""
    def curve(alpha: np.ndarray) -> np.ndarray:
        discreteness = np.minimum(((2 * alpha - 1) * l2**2 + 6 * l1) / (4 * mu**2), 3 * l1 / (2 * mu))
        return alpha * l2**2 / (2 * mu) + discreteness
    return curve


def _zhu_wang(q: float, base: IntegerRdp) -> IntegerRdp:
    """Zhu & Wang 2019, Thm. 6 at integer orders ≥ 2, capped by the base; 0 < q < 1."""
    log_q, log_1mq = math.log(q), math.log1p(-q)

    def curve(alpha: np.ndarray) -> np.ndarray:
        top = int(alpha.max())
        eps = np.concatenate([[0.0, 0.0], base(np.arange(2, top + 1, dtype=float))])  # eps[l] = ε(l)
        out = np.empty(alpha.shape)
        for n, a in enumerate(alpha.astype(int)):
            l = np.arange(2, a + 1, dtype=float)
            log_binom = special.gammaln(a + 1) - special.gammaln(l + 1) - special.gammaln(a - l + 1)
            terms = log_binom + l * log_q + (a - l) * log_1mq + (l - 1) * eps[2 : a + 1]
            terms[1:] += math.log(3)  # l ≥ 3
            first = (a - 1) * log_1mq + math.log1p((a - 1) * q)
            out[n] = min(float(special.logsumexp(np.append(terms, first))) / (a - 1), eps[a])
        # A_α ≥ 1 (a Rényi divergence is ≥ 0); clip the last-bit rounding of tiny values.
        return np.maximum(out, 0.0)
    return curve


def at_integer_orders(lam: np.ndarray, integer_rdp: IntegerRdp) -> np.ndarray:
    """``integer_rdp`` at the orders ``lam``; convex interpolation (module docstring) in between."""
    low, high = np.floor(lam), np.ceil(lam)
    needed = np.unique(np.concatenate([low[low >= 2], high]))
    values = dict(zip(needed, integer_rdp(needed)))
    values[1.0] = 0.0  # only ever multiplied by (n − 1) = 0: the cumulant is 0 at α = 1
    out = np.empty_like(lam)
    for n, (alpha, lo, hi) in enumerate(zip(lam, low, high)):
        if lo == hi:
            out[n] = values[lo]
        else:
            t = alpha - lo
            out[n] = ((1 - t) * (lo - 1) * values[lo] + t * (hi - 1) * values[hi]) / (alpha - 1)
    return out
