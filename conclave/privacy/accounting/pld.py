"""Tighter (ε, δ) for work fixed in advance: the privacy-loss distribution (PLD) of its releases.

RDP composes cleanly and is what the Rényi filter needs where a run adapts, but converting an RDP
curve to (ε, δ) loses a little: for the Gaussian and the Poisson-sampled Gaussian at our settings
the exact PLD gives about 9% less ε (STACK.md), for one Gaussian release (a public-cluster batch)
over 20% less. Where the releases are fixed before the run — a public-cluster batch, a DP-SGD
schedule, a fixed number of kNN or GNMax queries — both accountings are theorems for the same
run, and the smaller ε is published (``privacy.accounting.guarantee.worst_case_guarantee``).

Releases on the whole data are Gaussian in total, whose (ε, δ) curve has a closed form (Balle &
Wang 2018). Sampled ones need the numerical PLD: dp_accounting's (Google's DP library), ``PLDAccountant`` with pessimistic
discretisation and connect-the-dots, both directions of add/remove for sampled releases
(Koskela, Jälkö & Honkela 2020; Doroshenko, Ghazi, Kamath, Kumar & Manurangsi, "Connect the
dots", PETS 2022). Only Gaussian releases carry a plan here; Skellam, Laplace and
sparse-vector charges keep their RDP figure. Adaptive stopping is not covered by a PLD (no valid
PLD filter is known in general): the budget stays an RDP filter.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from conclave.errors import InvalidValue

THEOREM = ("privacy-loss distribution of the fixed plan (Koskela et al. 2020; dp_accounting's PLD accountant, "
           "pessimistic connect-the-dots discretisation, both directions of add/remove)")


@dataclass(frozen=True)
class GaussianSteps:
    """``count`` Gaussian releases at noise multiplier z = σ/Δ₂, each on a fresh Poisson sample of
    the records at ``sample_rate`` (1: the whole data)."""

    noise_multiplier: float
    count: int
    sample_rate: float = 1.0

    def __post_init__(self) -> None:
        if not (self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            raise InvalidValue(f"noise_multiplier must be a positive finite number, got {self.noise_multiplier}")
        if self.count < 0:
            raise InvalidValue(f"count must be >= 0, got {self.count}")
        if not 0 < self.sample_rate <= 1:
            raise InvalidValue(f"sample_rate must be in (0, 1], got {self.sample_rate}")

    def times(self, count: int) -> GaussianSteps:
        return GaussianSteps(self.noise_multiplier, self.count * count, self.sample_rate)


def pld_epsilon(plan: Sequence[GaussianSteps], delta: float) -> float:
    """ε at ``delta`` of composing every step of ``plan`` (module docstring); 0 for an empty plan.

    Releases on the whole data compose exactly into one Gaussian (Σ countᵢ/zᵢ² is the combined
    1/z², Dong, Roth & Su 2022, Cor. 3.3), so only sampled steps need the numerical composition."""
    if not 0 < delta < 1:
        raise InvalidValue(f"delta must be in (0, 1), got {delta}")
    whole = sum(step.count / step.noise_multiplier**2 for step in plan if step.sample_rate == 1)
    sampled = tuple(step for step in plan if step.sample_rate < 1 and step.count > 0)
    if not sampled:
        return analytic_gaussian_epsilon(1 / math.sqrt(whole), delta) if whole > 0 else 0.0
    combined = (GaussianSteps(1 / math.sqrt(whole), 1),) if whole > 0 else ()
    return _composed(combined + sampled, delta)


def analytic_gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """The exact ε of one Gaussian release at multiplier z, at ``delta``: the smallest ε with
    Φ(μ/2 − ε/μ) − e^ε·Φ(−μ/2 − ε/μ) ≤ δ, μ = 1/z (Balle & Wang, "Improving the Gaussian
    mechanism", ICML 2018, Thm. 8), by bisection (the left side falls as ε grows)."""
    from scipy import special

    mu = 1.0 / noise_multiplier

    def excess(epsilon: float) -> float:  # δ(ε) − δ, in a form that stays accurate for large ε
        first = special.ndtr(mu / 2 - epsilon / mu)
        second = math.exp(epsilon + special.log_ndtr(-mu / 2 - epsilon / mu))
        return first - second - delta

    if excess(0.0) <= 0:
        return 0.0
    low, high = 0.0, 1.0
    while excess(high) > 0:
        low, high = high, 2 * high
    while high - low > 1e-12 * max(1.0, high):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) > 0 else (low, middle)
    return high


VALUE_DISCRETIZATION = 1e-4  # dp_accounting's PLDAccountant default, kept


@functools.lru_cache(maxsize=64)
def _composed(steps: tuple[GaussianSteps, ...], delta: float) -> float:
    """dp_accounting's ``PLDAccountant`` composing ``steps`` (the same calls, in the same order), with
    each step's one-release PLD built once per process: the checkpoints of one DP-SGD schedule
    differ only in their counts, and building a sampled Gaussian's PLD costs most of a
    composition. Bit-identical to the accountant (tests/privacy/test_pld.py)."""
    from dp_accounting.pld import privacy_loss_distribution

    composed = privacy_loss_distribution.identity(value_discretization_interval=VALUE_DISCRETIZATION)
    for step in steps:
        if step.sample_rate < 1:
            release = _one_release(step.noise_multiplier, step.sample_rate).self_compose(step.count)
        else:  # the accountant's Gaussian event: count releases as one at z/√count
            release = _one_release(step.noise_multiplier / math.sqrt(step.count), 1.0)
        composed = composed.compose(release)
    return float(composed.get_epsilon_for_delta(delta))


@functools.lru_cache(maxsize=16)
def _one_release(standard_deviation: float, sample_rate: float):
    """The PLD of one Gaussian release (on a Poisson sample at ``sample_rate`` < 1), as
    ``PLDAccountant`` builds it for add/remove neighbours. Immutable: composing makes new ones."""
    from dp_accounting.pld import privacy_loss_distribution

    if sample_rate < 1:
        return privacy_loss_distribution.from_gaussian_mechanism(
            standard_deviation=standard_deviation, value_discretization_interval=VALUE_DISCRETIZATION,
            sampling_prob=sample_rate)
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=standard_deviation, value_discretization_interval=VALUE_DISCRETIZATION)
