"""Differentially private PCA by Analyze Gauss (Dwork, Talwar, Thakurta, Zhang, STOC 2014, Alg. 1).

Rows are scaled to unit L2 norm, so one row ``x`` (‖x‖ ≤ 1) changes the summed covariance
``A = Σ x xᵀ`` by ``x xᵀ`` when it is added or removed. We release ``A + E`` where ``E`` is
symmetric with the upper triangle (diagonal included) drawn i.i.d. N(0, σ²) and mirrored
below. What is released is therefore the upper triangle of ``A`` plus i.i.d. Gaussian noise,
whose L2 sensitivity is ``sqrt(Σ_{i≤j} (x_i x_j)²) ≤ ‖x xᵀ‖_F = ‖x‖² ≤ 1``: the Gaussian
mechanism with sensitivity 1 and noise multiplier z = σ.

Calibration: we do NOT use the classic ``σ = sqrt(2 ln(1.25/δ))/ε`` (valid only for ε < 1 and
composed loosely). We calibrate through Rényi DP: σ is the smallest noise multiplier whose
Gaussian RDP curve (Mironov 2017, Prop. 7: ε(λ) = λ/(2σ²)) converts to at most ``epsilon``
at ``delta`` on its own, and the ledger is charged that Gaussian RDP curve, so it composes
exactly with DP-SGD and the noisy counts. The top-p eigenvectors of the noisy matrix are
post-processing and cost nothing more.

The summed covariance is separable: each shard holder computes ``covariance_sum`` of its own
rows; the partial sums are added and noise is added ONCE to the total.

The released matrix is a float: its noise comes from ``NoiseSource.gaussian`` (an exact
sampler, rounded once), not from a textbook float sampler whose low bits leak (Mironov 2012).
Neighbours are add/remove of one row.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from privacy.accounting.charge import PrivacyCharge
from privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp, gaussian_charge, gaussian_rdp
from privacy.noise import NoiseSource


def normalise_rows(x: np.ndarray) -> np.ndarray:
    """Each row scaled to unit L2 norm (rows of zeros stay zero): the sensitivity bound needs ‖x‖ ≤ 1."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D array [n, d], got shape {x.shape}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1.0)


def covariance_sum(x: np.ndarray) -> np.ndarray:
    """``Σ x xᵀ`` over the unit-normalised rows of ``x`` (uncentred, as in Analyze Gauss)."""
    z = normalise_rows(x)
    return z.T @ z


def gaussian_noise_for_epsilon(epsilon: float, delta: float, orders: np.ndarray | None = None,
                               conversion: str = "tight") -> float:
    """Smallest noise multiplier z (sensitivity 1) whose Gaussian RDP gives ε ≤ ``epsilon`` at ``delta``."""
    if epsilon <= 0 or not np.isfinite(epsilon):
        raise ValueError(f"epsilon must be a positive finite number, got {epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    orders = DEFAULT_ORDERS if orders is None else np.asarray(orders, dtype=float)

    def eps_of(z: float) -> float:
        return epsilon_from_rdp(orders, gaussian_rdp(orders, z), delta, conversion)[0]

    low, high = 1e-3, 1.0
    while eps_of(high) > epsilon:  # ε falls as z grows: find a bracket, then bisect
        low, high = high, high * 2
        if high > 1e6:
            raise ValueError(f"no noise multiplier reaches epsilon={epsilon} at delta={delta}")
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

    def noisy_covariance(self, total: np.ndarray, noise: NoiseSource) -> np.ndarray:
        """``total`` (the summed covariance of all shards) with its upper triangle released
        under Gaussian noise and mirrored below."""
        total = np.asarray(total, dtype=np.float64)
        if total.ndim != 2 or total.shape[0] != total.shape[1]:
            raise ValueError(f"expected a square summed covariance, got shape {total.shape}")
        upper = np.triu_indices(total.shape[0])
        released = np.zeros_like(total)
        released[upper] = noise.gaussian(total[upper], self.noise_multiplier)
        return released + np.triu(released, 1).T

    def release(self, total: np.ndarray, components: int, noise: NoiseSource) -> np.ndarray:
        """Top-``components`` eigenvectors of the noisy matrix, as columns of a [d, p] projection."""
        d = np.asarray(total).shape[0]
        if not 1 <= components <= d:
            raise ValueError(f"components must be in [1, {d}], got {components}")
        values, vectors = np.linalg.eigh(self.noisy_covariance(total, noise))
        order = np.argsort(values)[::-1][:components]
        return vectors[:, order]
