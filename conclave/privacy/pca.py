"""Differentially private PCA by Analyze Gauss (Dwork, Talwar, Thakurta, Zhang, STOC 2014, Alg. 1).

The summed covariance of unit-norm rows plus symmetric Gaussian noise, calibrated and charged as
the Gaussian RDP curve so it composes exactly with DP-SGD; one holder noises it once
(``AnalyzeGauss``), several meet in a secure sum (``SecureAnalyzeGauss``). The sensitivity:
docs/privacy.md, "Analyze Gauss".
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp, gaussian_charge, gaussian_rdp
from conclave.privacy.accounting.skellam import skellam_charge
from conclave.privacy.exact_distances import exact_squared
from conclave.privacy.noise import NoiseSource
from conclave.privacy.secure_release import CalibratedRelease, party_share, release_plan, summed_shares
from conclave.privacy.secure_sum import DOMINATING_SENSITIVITY, PairwiseMasks, SecureSumPlan, decode


def normalise_rows(x: np.ndarray) -> np.ndarray:
    """Each row scaled to unit L2 norm (rows of zeros stay zero): the sensitivity bound needs ‖x‖ ≤ 1."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise InvalidValue(f"expected a 2-D array [n, d], got shape {x.shape}")
    norms = np.sqrt(exact_squared(x, np.zeros_like(x)))[:, None]  # each row's own, bit for bit
    return x / np.where(norms > 0, norms, 1.0)


def covariance_sum(x: np.ndarray) -> np.ndarray:
    """``Σ x xᵀ`` over the unit-normalised rows of ``x`` (uncentred, as in Analyze Gauss)."""
    z = normalise_rows(x)
    return z.T @ z


def upper_triangle(matrix: np.ndarray) -> np.ndarray:
    """The entries on and above the diagonal of a square matrix, row by row (d(d+1)/2 of them)."""
    matrix = np.asarray(matrix, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise InvalidValue(f"expected a square matrix, got shape {matrix.shape}")
    return matrix[np.triu_indices(matrix.shape[0])]


def symmetric_from_upper(upper: np.ndarray) -> np.ndarray:
    """The symmetric matrix whose ``upper_triangle`` is ``upper`` (mirrored below the diagonal)."""
    upper = np.asarray(upper, dtype=np.float64)
    d = (math.isqrt(8 * upper.size + 1) - 1) // 2
    if upper.ndim != 1 or d * (d + 1) // 2 != upper.size:
        raise InvalidValue(f"{upper.size} entries are not the upper triangle of a square matrix")
    matrix = np.zeros((d, d))
    matrix[np.triu_indices(d)] = upper
    return matrix + np.triu(matrix, 1).T


def top_components(matrix: np.ndarray, components: int) -> np.ndarray:
    """Top-``components`` eigenvectors of a symmetric matrix, as columns of a [d, p] projection."""
    d = matrix.shape[0]
    if not 1 <= components <= d:
        raise InvalidValue(f"components must be in [1, {d}], got {components}")
    values, vectors = np.linalg.eigh(matrix)
    order = np.argsort(values)[::-1][:components]
    return vectors[:, order]


def gaussian_noise_for_epsilon(epsilon: float, delta: float, orders: np.ndarray | None = None,
                               conversion: str = "tight") -> float:
    """Smallest noise multiplier z (sensitivity 1) whose Gaussian RDP gives ε ≤ ``epsilon`` at ``delta``."""
    if epsilon <= 0 or not np.isfinite(epsilon):
        raise InvalidValue(f"epsilon must be a positive finite number, got {epsilon}")
    if not 0 < delta < 1:
        raise InvalidValue(f"delta must be in (0, 1), got {delta}")
    orders = DEFAULT_ORDERS if orders is None else np.asarray(orders, dtype=float)

    def eps_of(z: float) -> float:
        return epsilon_from_rdp(orders, gaussian_rdp(orders, z), delta, conversion)[0]

    low, high = 1e-3, 1.0
    while eps_of(high) > epsilon:  # ε falls as z grows: find a bracket, then bisect
        low, high = high, high * 2
        if high > 1e6:
            raise InvalidValue(f"no noise multiplier reaches epsilon={epsilon} at delta={delta}")
    for _ in range(100):
        mid = (low + high) / 2
        if eps_of(mid) > epsilon:
            low = mid
        else:
            high = mid
    return high


@dataclass(frozen=True)
class AnalyzeGauss:
    """Analyze Gauss at (``epsilon``, ``delta``): calibrate once, charge, then release the top-p subspace."""

    epsilon: float
    delta: float
    orders: np.ndarray | None = None
    noise_multiplier: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", gaussian_noise_for_epsilon(self.epsilon, self.delta, self.orders))

    def charge(self) -> PrivacyCharge:
        """The Gaussian RDP curve of one release (charge the ledger with this before releasing)."""
        return gaussian_charge(self.noise_multiplier, count=1, label="dp-pca", orders=self.orders)

    def summary(self) -> dict[str, Any]:
        """What ``privacy.json`` says about this release's noise."""
        return {"mechanism": "Analyze Gauss, Gaussian noise added by the one holder",
                "noise_multiplier": self.noise_multiplier}

    def noisy_covariance(self, total: np.ndarray, noise: NoiseSource) -> np.ndarray:
        """``total`` (the summed covariance of all shards) with its upper triangle released
        under Gaussian noise and mirrored below."""
        total = np.asarray(total, dtype=np.float64)
        if total.ndim != 2 or total.shape[0] != total.shape[1]:
            raise InvalidValue(f"expected a square summed covariance, got shape {total.shape}")
        upper = np.triu_indices(total.shape[0])
        released = np.zeros_like(total)
        released[upper] = noise.gaussian(total[upper], self.noise_multiplier)
        return released + np.triu(released, 1).T

    def release(self, total: np.ndarray, components: int, noise: NoiseSource) -> np.ndarray:
        """Top-``components`` eigenvectors of the noisy matrix, as columns of a [d, p] projection."""
        d = np.asarray(total).shape[0]
        if not 1 <= components <= d:
            raise InvalidValue(f"components must be in [1, {d}], got {components}")
        return top_components(self.noisy_covariance(total, noise), components)


@dataclass(frozen=True)
class SecureAnalyzeGauss(CalibratedRelease):
    """Analyze Gauss over parties whose covariance sums meet only in a secure sum (Skellam noise).

    What is summed: each party's ``upper_triangle(Σ x xᵀ)`` over its unit-normalised rows, D =
    d(d+1)/2 entries. Its L2 sensitivity is 1: one row x (‖x‖ ≤ 1) added or removed changes it
    by ``upper_triangle(x xᵀ)``, and ``‖upper_triangle(x xᵀ)‖₂² = Σ_{i≤j} x_i²x_j² ≤ Σ_{i,j}
    x_i²x_j² = ‖x xᵀ‖_F² = ‖x‖⁴ ≤ 1``. The plan (``privacy.secure_sum``) projects each part onto
    the ball of the declared records (‖Σ x xᵀ‖_F ≤ n, and projection is non-expansive), scales by
    γ and rounds, so in the integer domain Δ₂ = γ + √D and Δ₁ = √D·Δ₂, and the total carries
    Skellam noise of variance μ = (z·Δ₂)² against any one owner. The decoded total is mirrored
    into a symmetric matrix and its top eigenvectors are released (post-processing).

    Charge (fixed before the dimension is known). The plan picks γ ≥ √D/0.05, so Δ₂ ≥ 21·√D ≥
    21. At μ = (z·Δ₂)² the Skellam bound (Agarwal, Kairouz & Liu 2021, Cor. 3.6) reads

        ε(α) = α/(2z²) + min( (2α − 1)/(4z⁴Δ₂²) + 3√D/(2z⁴Δ₂³),  3√D/(2z²Δ₂) ),

    and with √D/Δ₂ ≤ 1/21 and 1/Δ₂² ≤ 1/21² every term is at most its value at Δ₂ = 21, √D = 1:
    the Skellam curve at Δ₁ = Δ₂ = 21, μ = (21z)², which ``charge`` returns. A plan the ring
    caps below that scale is refused (``plan``). z is calibrated so that this charge alone gives
    at most ``epsilon`` at ``delta``.
    """

    def _charge_at(self, noise_multiplier: float) -> PrivacyCharge:
        bound = DOMINATING_SENSITIVITY
        return skellam_charge(bound, bound, (noise_multiplier * bound) ** 2, label="dp-pca", orders=self.orders)


    def summary(self) -> dict[str, Any]:
        """What ``privacy.json`` says about this release's noise."""
        return {"mechanism": "Analyze Gauss through the secure sum, Skellam noise shares",
                "noise_multiplier": self.noise_multiplier}

    def plan(self, dimension: int, owners: Sequence[str], norm_bound: float) -> SecureSumPlan:
        """The secure sum of d×d covariances (``dimension`` d) over parties ``owners[rank]``, each
        holding at most ``norm_bound`` rows (public: the declared records)."""
        if not isinstance(dimension, int) or dimension < 1:
            raise InvalidValue(f"dimension must be a positive integer, got {dimension!r}")
        return release_plan(self.charge(), dimension=dimension * (dimension + 1) // 2, owners=owners,
                            norm_bound=norm_bound, noise_multiplier=self.noise_multiplier, integer_inputs=False,
                            what="secure DP-PCA")

    def share(self, covariance: np.ndarray, plan: SecureSumPlan, owners: Sequence[str], masks: PairwiseMasks,
              noise: NoiseSource) -> np.ndarray:
        """One party's masked share of its covariance sum ``covariance`` (what leaves the party)."""
        return party_share(upper_triangle(covariance), plan, owners, masks, noise)

    def release(self, shares: Sequence[np.ndarray], components: int, plan: SecureSumPlan) -> np.ndarray:
        """Top-``components`` eigenvectors of the decoded noisy total (one share per party)."""
        return top_components(symmetric_from_upper(decode(summed_shares(shares, plan), plan)), components)
