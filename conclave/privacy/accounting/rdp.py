"""Rényi differential privacy: one grid of orders, the per-mechanism curves, and (ε, δ).

Every charge in a run is an RDP curve on ``DEFAULT_ORDERS``; curves of successive
releases add up order by order (Mironov 2017, Prop. 1) and the total is converted to
(ε, δ) by minimising over the orders. Two conversions are offered:

* ``"classic"`` — Mironov 2017, Prop. 3: ε = RDP(λ) + log(1/δ)/(λ − 1). This is what the
  PATE papers (2017, 2018) used, so published PATE numbers are reproduced with it.
* ``"tight"`` — Balle, Barthe, Gaboardi, Hsu, Sato 2020, "Hypothesis testing
  interpretations and Rényi DP", Thm. 21 (also Canonne, Kamath, Steinke 2020):
  ε = RDP(λ) + log((λ − 1)/λ) − (log δ + log λ)/(λ − 1). Always at least as good as the
  classic one; it is what Opacus's RDP accountant uses and what the ledger reports.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from scipy import special

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.pld import GaussianSteps

# Opacus's default alphas (1.1 … 10.9 by 0.1, then 12 … 63) so DP-SGD figures match Opacus
# exactly, extended to large integer orders: PATE queries with σ = 40 … 200 and small
# per-query costs reach their optimum at orders in the hundreds or thousands.
DEFAULT_ORDERS: np.ndarray = np.concatenate(
    [
        1 + np.arange(1, 100) / 10.0,
        np.arange(12, 64, dtype=float),
        np.arange(64, 256, 8, dtype=float),
        np.round(np.geomspace(256, 8192, 16)),
    ]
)

CONVERSIONS = ("tight", "classic")


def _orders(orders) -> np.ndarray:
    grid = DEFAULT_ORDERS if orders is None else np.asarray(orders, dtype=float)
    if grid.ndim != 1 or grid.size == 0 or np.any(grid <= 1):
        raise InvalidValue("orders must be a non-empty 1-D list of numbers > 1")
    return grid


def epsilon_from_rdp(orders, rdp, delta: float, conversion: str = "tight") -> tuple[float, float]:
    """(ε, best order) for an RDP curve at target δ, minimised over the orders.

    ``conversion`` is "tight" (Balle et al. 2020, Thm. 21) or "classic" (Mironov 2017,
    Prop. 3); see the module docstring. A curve that is zero everywhere (nothing spent) is
    (0, 0)-DP and returns ε = 0 with order NaN. An infinite curve returns (inf, NaN).
    """
    if conversion not in CONVERSIONS:
        raise InvalidValue(f"conversion must be one of {CONVERSIONS}, got {conversion!r}")
    lam = DEFAULT_ORDERS if orders is None else np.asarray(orders, dtype=float)
    values = np.asarray(rdp, dtype=float)
    if values.shape != lam.shape:
        raise InvalidValue(f"rdp {values.shape} must align with orders {lam.shape}")
    if not 0 < delta < 1:
        raise InvalidValue(f"delta must be in (0, 1), got {delta}")
    # ε(λ) = RDP(λ) + offset(λ) + log(1/δ)·slope(λ); the terms of the orders are worked out
    # once per grid (the ledger converts after every charge, and this was half its cost).
    offset, slope = _conversion_terms(lam.tobytes(), conversion)
    if not values.any():
        return 0.0, math.nan
    eps = values + (offset - math.log(delta) * slope)
    eps[np.isnan(eps)] = math.inf  # no bound at that order (e.g. ∞ − ∞ in a curve)
    best = int(np.argmin(eps))
    if not np.isfinite(eps[best]):
        return math.inf, math.nan
    # ε-DP with ε < 0 is meaningless; every mechanism is (0, δ)-DP at best.
    return max(float(eps[best]), 0.0), float(lam[best])


@functools.lru_cache(maxsize=16)
def _conversion_terms(grid: bytes, conversion: str) -> tuple[np.ndarray, np.ndarray]:
    """(offset, slope) of ``conversion`` on the orders whose float64 bytes are ``grid``."""
    lam = _orders(np.frombuffer(grid, dtype=float))
    slope = 1 / (lam - 1)
    if conversion == "classic":  # Mironov 2017, Prop. 3
        offset = np.zeros_like(lam)
    else:  # Balle et al. 2020, Thm. 21
        offset = np.log((lam - 1) / lam) - np.log(lam) * slope
    offset.flags.writeable = slope.flags.writeable = False  # shared by every later call
    return offset, slope


def gaussian_rdp(orders, noise_multiplier: float) -> np.ndarray:
    """Gaussian mechanism with noise σ = z·Δ₂: (λ, λ/(2z²))-RDP (Mironov 2017, Prop. 7)."""
    if not noise_multiplier > 0:
        raise InvalidValue(f"noise_multiplier must be > 0, got {noise_multiplier}")
    lam = _orders(orders)
    return lam / (2 * noise_multiplier**2)


def pure_dp_rdp(orders, epsilon: float) -> np.ndarray:
    """RDP implied by ε-DP: (λ, min(ε, λε²/2)).

    ε-DP is (∞, ε)-RDP and RDP is monotone in λ (Mironov 2017, Prop. 10), giving ε;
    ε-DP implies ½ε²-zCDP (Bun & Steinke 2016, Prop. 3.3), i.e. (λ, λε²/2)-RDP.
    """
    if not epsilon >= 0:
        raise InvalidValue(f"epsilon must be >= 0, got {epsilon}")
    lam = _orders(orders)
    return np.minimum(epsilon, lam * epsilon**2 / 2)


def _log_a_integer(q: float, sigma: float, alpha: int) -> float:
    """log A_α for integer α: the binomial expansion (Mironov, Talwar, Zhang 2019, §3.3)."""
    i = np.arange(alpha + 1, dtype=float)
    log_binom = special.gammaln(alpha + 1) - special.gammaln(i + 1) - special.gammaln(alpha - i + 1)
    terms = log_binom + i * math.log(q) + (alpha - i) * math.log1p(-q) + (i * i - i) / (2 * sigma**2)
    return float(special.logsumexp(terms))


def _log_a_fractional(q: float, sigma: float, alpha: float) -> float:
    """log A_α for fractional α: the two convergent series split at z₀ (MTZ 2019, §3.3).

    Terms are summed with their signs (binom(α, i) alternates once i > α) until both
    series' terms fall below e^-30, as in the paper's reference implementation.
    """
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    signs: list[float] = []
    log_s0: list[float] = []  # terms of the integral over (-inf, z0]
    log_s1: list[float] = []  # terms of the integral over [z0, inf)
    i = 0
    while True:
        coef = special.binom(alpha, i)
        j = alpha - i
        log_coef = math.log(abs(coef))
        # log P[N(0, σ²) ≥ i − z0] and log P[N(0, σ²) ≥ z0 − j]
        tail0 = special.log_ndtr((z0 - i) / sigma)
        tail1 = special.log_ndtr((j - z0) / sigma)
        s0 = log_coef + i * math.log(q) + j * math.log1p(-q) + (i * i - i) / (2 * sigma**2) + tail0
        s1 = log_coef + j * math.log(q) + i * math.log1p(-q) + (j * j - j) / (2 * sigma**2) + tail1
        signs.append(1.0 if coef > 0 else -1.0)
        log_s0.append(s0)
        log_s1.append(s1)
        i += 1
        if max(s0, s1) < -30:
            break
    a0, sign0 = special.logsumexp(log_s0, b=signs, return_sign=True)
    a1, sign1 = special.logsumexp(log_s1, b=signs, return_sign=True)
    if sign0 < 0 or sign1 < 0:
        raise ArithmeticError("sampled Gaussian series summed to a negative value")
    return float(np.logaddexp(a0, a1))


def sampled_gaussian_rdp(orders, sample_rate: float, noise_multiplier: float, steps: int) -> np.ndarray:
    """RDP of ``steps`` Poisson-subsampled Gaussian mechanism steps (DP-SGD).

    Mironov, Talwar, Zhang 2019, "Rényi differential privacy of the sampled Gaussian
    mechanism", §3.3: RDP(λ) = log(A_λ)/(λ − 1) with A_λ = E_{z~μ0}[(μ(z)/μ0(z))^λ],
    μ0 = N(0, σ²), μ = (1 − q)μ0 + qN(1, σ²); closed binomial sum for integer λ, two
    convergent series for fractional λ. Equals Opacus's ``compute_rdp`` (tested).
    """
    lam = _orders(orders)
    if not 0 <= sample_rate <= 1:
        raise InvalidValue(f"sample_rate must be in [0, 1], got {sample_rate}")
    if steps < 0:
        raise InvalidValue(f"steps must be >= 0, got {steps}")
    if sample_rate == 0 or steps == 0:
        return np.zeros_like(lam)
    if noise_multiplier == 0:
        return np.full_like(lam, np.inf)
    if not noise_multiplier > 0:
        raise InvalidValue(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    if sample_rate == 1:
        return steps * gaussian_rdp(lam, noise_multiplier)
    return steps * _sampled_gaussian_step(lam.tobytes(), float(sample_rate), float(noise_multiplier))


@functools.lru_cache(maxsize=256)
def _sampled_gaussian_step(grid: bytes, sample_rate: float, noise_multiplier: float) -> np.ndarray:
    """One step's curve on the orders whose float64 bytes are ``grid`` (read-only: cached, as
    the same (q, σ) is priced for every checkpoint of a run and every epoch count ``plan`` tries)."""
    lam = np.frombuffer(grid, dtype=float)
    out = np.empty_like(lam)
    for n, alpha in enumerate(lam):
        if float(alpha).is_integer():
            log_a = _log_a_integer(sample_rate, noise_multiplier, int(alpha))
        else:
            log_a = _log_a_fractional(sample_rate, noise_multiplier, float(alpha))
        out[n] = log_a / (alpha - 1)
    # A_λ ≥ 1 (a Rényi divergence is ≥ 0); clip the last-bit rounding of tiny values.
    step = np.maximum(out, 0.0)
    step.flags.writeable = False
    return step


# --- charge builders: what mechanisms and training loops hand to the ledger ---------------


def pure_epsilon_charge(epsilon: float, label: str = "", orders=None, count: int = 1,
                        neighbouring: Neighbouring = Neighbouring.ADD_REMOVE) -> PrivacyCharge:
    """``count`` releases, each ε-DP (e.g. LNMax with ε₀ = 2/b, Laplace noisy counts)."""
    lam = _orders(orders)
    return PrivacyCharge(
        lam, count * pure_dp_rdp(lam, epsilon), label=label, details={"epsilon": epsilon, "count": count},
        neighbouring=neighbouring,
    )


def gaussian_charge(noise_multiplier: float, count: int = 1, label: str = "", orders=None,
                    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE) -> PrivacyCharge:
    """``count`` Gaussian releases with noise multiplier z = σ/Δ₂: count·λ/(2z²)."""
    lam = _orders(orders)
    return PrivacyCharge(
        lam,
        count * gaussian_rdp(lam, noise_multiplier),
        label=label,
        details={"noise_multiplier": noise_multiplier, "count": count},
        neighbouring=neighbouring,
        pld=(GaussianSteps(noise_multiplier, count),),
    )


def sampled_gaussian_charge(
    sample_rate: float, noise_multiplier: float, steps: int, label: str = "", orders=None
) -> PrivacyCharge:
    """``steps`` DP-SGD steps (Poisson rate q, noise multiplier z); see sampled_gaussian_rdp."""
    lam = _orders(orders)
    return PrivacyCharge(
        lam,
        sampled_gaussian_rdp(lam, sample_rate, noise_multiplier, steps),
        label=label,
        details={"sample_rate": sample_rate, "noise_multiplier": noise_multiplier, "steps": steps},
        pld=(GaussianSteps(noise_multiplier, steps, sample_rate),) if sample_rate > 0 else (),
    )


def approximate_dp_charge(
    epsilon: float, delta: float, label: str = "", orders=None, count: int = 1,
    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE,
) -> PrivacyCharge:
    """``count`` releases each ε-indistinguishable except with probability ``delta`` in total.

    The pure part becomes the RDP curve count·min(ε, λε²/2) and ``delta`` goes to
    ``extra_delta``. This is δ-approximate RDP (Bun & Steinke 2016, §8: (ε, δ)-DP implies
    δ-approximate ½ε²-zCDP); it composes with RDP curves by adding curves and adding δ's,
    and the ledger converts the curve at its δ and adds the extra δ's on top.
    """
    if not 0 <= delta < 1:
        raise InvalidValue(f"delta must be in [0, 1), got {delta}")
    lam = _orders(orders)
    return PrivacyCharge(
        lam,
        count * pure_dp_rdp(lam, epsilon),
        extra_delta=delta,
        label=label,
        details={"epsilon": epsilon, "delta": delta, "count": count},
        neighbouring=neighbouring,
    )


def unbounded_charge(reason: str, label: str = "", orders=None,
                     neighbouring: Neighbouring = Neighbouring.ADD_REMOVE) -> PrivacyCharge:
    """A release with no finite DP guarantee (e.g. NZC); a ledger with a budget refuses it."""
    if not reason:
        raise InvalidValue("an unbounded charge must say why")
    lam = _orders(orders)
    return PrivacyCharge(lam, np.full_like(lam, np.inf), unbounded=True, reason=reason, label=label,
                         neighbouring=neighbouring)


def sum_charges(charges: list[PrivacyCharge], label: str = "") -> PrivacyCharge:
    """Compose charges on the same orders: curves add (Mironov 2017, Prop. 1), δ's add."""
    if not charges:
        raise InvalidValue("nothing to compose")
    lam = charges[0].orders
    for charge in charges[1:]:
        if not np.array_equal(charge.orders, lam):
            raise InvalidValue("charges are on different orders")
        if charge.neighbouring != charges[0].neighbouring:
            raise InvalidValue(f"charges hold for different neighbouring relations ('{charges[0].neighbouring}', "
                             f"'{charge.neighbouring}'); they do not compose as one")
    reasons = "; ".join(dict.fromkeys(c.reason for c in charges if c.unbounded))  # one reason once, however often
    plans = [c.pld for c in charges]
    return PrivacyCharge(
        lam,
        np.sum([c.rdp for c in charges], axis=0),
        extra_delta=float(sum(c.extra_delta for c in charges)),
        unbounded=any(c.unbounded for c in charges),
        reason=reasons,
        label=label or "+".join(c.label for c in charges if c.label),
        neighbouring=charges[0].neighbouring,
        pld=None if any(p is None for p in plans) else tuple(step for p in plans for step in p),
    )
