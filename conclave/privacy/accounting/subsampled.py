"""Gaussian releases computed on one Poisson sample of the records (record-level add/remove).

A release such as a kNN vote histogram is a function of a Poisson sample of the private
records (each record in independently with probability q), not a sum of per-record terms as
in DP-SGD. Its cost is still the sampled Gaussian mechanism's: fix the sample of the other
records, which is distributed alike with and without the added record. Given it, the pair of
output distributions is (N(g, Σ), (1 − q)·N(g, Σ) + q·N(g + v, Σ)) with v the change the record
makes when sampled; whitened by the noise, ‖v‖ ≤ 1/z, and by rotation invariance this is the
one-dimensional pair of Mironov, Talwar & Zhang 2019, "Rényi Differential Privacy of the Sampled
Gaussian Mechanism" (§3.3, both directions; smaller shifts cost less). exp((λ − 1)·D_λ) is
jointly convex, so mixing over the others' sample costs no more than the worst fixed sample:
the MTZ curve at multiplier z (``rdp.sampled_gaussian_rdp``: their binomial sum at integer
orders, their series at fractional ones, as Opacus computes it).

Several Gaussian releases on the *same* sample are one Gaussian release of the stacked vector,
whitened coordinate by coordinate: multiplier z = (Σ (Δᵢ/σᵢ)²)^(-1/2). Charging them as separate
subsampled releases would undercount: with a shared sample the added record is in all of them or
in none, and the separate charges sum to less than the joint one.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.pld import GaussianSteps
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, sampled_gaussian_rdp


@dataclass(frozen=True)
class GaussianRelease:
    """One release f(sample) + N(0, σ²·I); ``sensitivity`` bounds ‖f(S ∪ {x}) − f(S)‖₂."""

    sigma: float
    sensitivity: float

    def __post_init__(self) -> None:
        if not (self.sigma > 0 and self.sensitivity > 0):
            raise InvalidValue(f"a Gaussian release needs sigma > 0 and sensitivity > 0, got {self.sigma}, "
                             f"{self.sensitivity}")


def shared_sample_noise_multiplier(releases: Sequence[GaussianRelease]) -> float:
    """The noise multiplier of ``releases`` made on one sample, as one whitened Gaussian release."""
    if not releases:
        raise InvalidValue("no releases to combine")
    return 1.0 / math.sqrt(sum((r.sensitivity / r.sigma) ** 2 for r in releases))


def poisson_sampled_gaussian_charge(sample_rate: float, releases: Sequence[GaussianRelease], count: int = 1,
                                    label: str = "", orders=None) -> PrivacyCharge:
    """``count`` rounds, each a fresh Poisson sample at ``sample_rate`` and ``releases`` on it.

    Each round is the MTZ 2019 sampled Gaussian mechanism at ``shared_sample_noise_multiplier``
    (module docstring); rounds with independent samples and noise compose by adding curves. The
    bound holds for one record added or removed, directly (no per-teacher vote in between).
    """
    if count < 0:
        raise InvalidValue(f"count must be >= 0, got {count}")
    lam = DEFAULT_ORDERS if orders is None else np.asarray(orders, dtype=float)
    multiplier = shared_sample_noise_multiplier(releases)
    return PrivacyCharge(
        lam, sampled_gaussian_rdp(lam, sample_rate, multiplier, count), label=label,
        details={"sample_rate": sample_rate, "noise_multiplier": multiplier, "count": count},
        neighbouring=Neighbouring.ADD_REMOVE,
        pld=(GaussianSteps(multiplier, count, sample_rate),),
    )
