"""What a DP-SGD run will cost, known before it starts and computed without torch.

The schedule (Poisson rate q, noise multiplier σ, steps) follows from public numbers — the
declared number of records, the expected batch, the epochs and σ or a target ε — and fixes
the run's charge: the sampled Gaussian RDP (Mironov, Talwar, Zhang 2019), or across owners
the secure sum's Poisson-subsampled Skellam RDP (``learning.secure_dpsgd``). The ledger is
charged with it before training, and ``conclave plan`` shows it before any data is read, so
nothing here imports torch or Opacus: σ for a target ε is found by Opacus's own bisection
(``opacus.accountants.utils.get_noise_multiplier``) on the same RDP and conversion, which
gives the same σ (tested against Opacus).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, sampled_gaussian_charge, sampled_gaussian_rdp
from conclave.privacy.accounting.skellam import subsampled_skellam_charge
from conclave.privacy.secure_release import skellam_multiplier_for_epsilon
from conclave.privacy.secure_sum import DOMINATING_SENSITIVITY

# How per-example gradient norms are found. "hooks", "functorch" and "ew" materialise every
# per-example gradient; "ghost" (ghost clipping, Li et al. 2022, "Large language models can be
# strong differentially private learners") computes the norms of Linear layers without them and
# takes a second backward pass with per-example weights, falling back to per-example gradients
# for other layers. The clipped sum and the noise are the same, so is the privacy. A mask must
# act on each per-example gradient before its norm is taken, so masks need a materialising mode.
# "bk" is book-keeping (``learning.bookkeeping``): norms and the clipped sum from one backward
# pass, for models that train Linear, Conv2d and GroupNorm layers only.
# "auto" (the default) times a step of each on a synthetic batch and keeps the fastest
# (``learning.grad_sample_modes``); with reproducible noise it takes the hooks, untimed.
GRAD_SAMPLE_MODES = ("auto", "hooks", "functorch", "ew", "ghost", "bk")
LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class DPSGDConfig:
    """One DP-SGD run. Give exactly one of ``noise_multiplier`` and ``target_epsilon``.

    ``batch_size`` is the *expected* batch size: batches are Poisson-sampled with rate
    batch_size / n. ``lr_overrides`` maps parameter-name prefixes to their own learning
    rate (first match wins), e.g. (("classifier.", 0.8),) as in the sparse paper.
    ``max_physical_batch_size`` processes a large logical batch in chunks (Opacus's batch
    splitting): same step, same noise, same privacy, bounded memory.
    """

    epochs: int = 1
    batch_size: int = 64
    lr: float = 0.1
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    momentum: float = 0.0
    grad_sample_mode: str = "auto"
    lr_overrides: tuple[tuple[str, float], ...] = ()
    max_physical_batch_size: int | None = None  # split big Poisson batches to bound memory
    lr_schedule: str = "constant"  # or "cosine": decays every learning rate to 0 over the run

    def __post_init__(self) -> None:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise InvalidValue("give exactly one of noise_multiplier and target_epsilon")
        if self.noise_multiplier is not None and self.noise_multiplier <= 0:
            raise InvalidValue(f"noise_multiplier must be > 0, got {self.noise_multiplier}")
        if self.target_epsilon is not None and self.target_epsilon <= 0:
            raise InvalidValue(f"target_epsilon must be > 0, got {self.target_epsilon}")
        if self.epochs < 1:
            raise InvalidValue(f"epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise InvalidValue(f"batch_size must be >= 1, got {self.batch_size}")
        if self.lr <= 0 or any(lr <= 0 for _, lr in self.lr_overrides):
            raise InvalidValue("learning rates must be > 0")
        if self.max_grad_norm <= 0:
            raise InvalidValue(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        if not 0 < self.delta < 1:
            raise InvalidValue(f"delta must be in (0, 1), got {self.delta}")
        if not 0 <= self.momentum < 1:
            raise InvalidValue(f"momentum must be in [0, 1), got {self.momentum}")
        if self.grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise InvalidValue(f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES}, got {self.grad_sample_mode!r}")
        if self.max_physical_batch_size is not None and self.max_physical_batch_size < 1:
            raise InvalidValue(f"max_physical_batch_size must be >= 1, got {self.max_physical_batch_size}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise InvalidValue(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")


@dataclass(frozen=True)
class DPSchedule:
    """What a run will cost, known before it starts: Poisson rate q, noise multiplier σ and
    steps fix the sampled Gaussian RDP — or, across owners (``secure``), the subsampled
    Skellam RDP of the secure sum — so a ledger can be charged before training."""

    noise_multiplier: float
    sample_rate: float
    steps: int
    charge: PrivacyCharge
    num_examples: int  # the N it was computed from (declared, public)
    secure: bool = False  # across owners through secure aggregation (Skellam noise)
    # A screening run's steps before these, at the same q and σ (its model picks the columns the
    # steps' model reads, so every checkpoint depends on it); ``charge`` is the steps' alone.
    screen_steps: int = 0

    @property
    def screen_charge(self) -> PrivacyCharge | None:
        """The screening run's steps (None: no screening)."""
        if not self.screen_steps:
            return None
        return dp_step_charge(self.sample_rate, self.noise_multiplier, self.screen_steps, "dpsgd-screening",
                              self.secure)

    @property
    def whole_charge(self) -> PrivacyCharge:
        """Everything the schedule charges: the screening steps, then the steps."""
        return self.charge_after(self.steps, self.charge.label)

    def charge_after(self, steps: int, label: str) -> PrivacyCharge:
        """The cost of the screening steps and the first ``steps`` steps (a checkpoint's)."""
        return dp_step_charge(self.sample_rate, self.noise_multiplier, self.screen_steps + steps, label, self.secure)


def dp_step_charge(sample_rate: float, noise_multiplier: float, steps: int, label: str, secure: bool) -> PrivacyCharge:
    """``steps`` DP-SGD steps: the sampled Gaussian, or across owners the secure sum's Skellam."""
    if secure:
        return secure_charge(sample_rate, noise_multiplier, steps, label)
    return sampled_gaussian_charge(sample_rate, noise_multiplier, steps, label=label)


def dp_schedule(num_examples: int, config: DPSGDConfig, label: str = "dpsgd", secure: bool = False,
                screen_steps: int = 0) -> DPSchedule:
    """The schedule ``train_dp`` follows on ``num_examples`` examples: ⌈n/B⌉ steps per epoch
    at rate q = 1/⌈n/B⌉ (Opacus's Poisson loader), σ given or calibrated so that ε after
    ``config.epochs`` epochs is at most ``target_epsilon``: as Opacus's RDP accountant does, or
    across owners (``secure``) with the secure sum's own accounting. ``screen_steps``: a screening
    run's steps before them at the same q and σ (across owners only), which a target ε covers too."""
    if num_examples < 1:
        raise InvalidValue("cannot train on an empty dataset")
    if screen_steps < 0 or (screen_steps and not secure):
        raise InvalidValue("screening steps run across owners (secure), zero or more")
    steps_per_epoch = math.ceil(num_examples / config.batch_size)
    sample_rate = 1 / steps_per_epoch
    steps = steps_per_epoch * config.epochs
    if secure:
        sigma = config.noise_multiplier or calibrated_noise_multiplier(sample_rate, screen_steps + steps,
                                                                       config.target_epsilon, config.delta)
        return DPSchedule(sigma, sample_rate, steps, secure_charge(sample_rate, sigma, steps, label), num_examples,
                          secure=True, screen_steps=screen_steps)
    if config.noise_multiplier is not None:
        sigma = float(config.noise_multiplier)
    else:
        sigma = gaussian_noise_multiplier(config.target_epsilon, config.delta, sample_rate, config.epochs)
    return DPSchedule(sigma, sample_rate, steps, sampled_gaussian_charge(sample_rate, sigma, steps, label=label),
                      num_examples)


def secure_charge(sample_rate: float, noise_multiplier: float, steps: int, label: str) -> PrivacyCharge:
    """``steps`` steps of DP-SGD over any plan of noise multiplier z: the Poisson-subsampled
    Skellam mechanism at the dominating Δ₂ = Δ₁ = 21 (``learning.secure_dpsgd``'s docstring)."""
    bound = DOMINATING_SENSITIVITY
    return subsampled_skellam_charge(sample_rate, bound, bound, (noise_multiplier * bound) ** 2, steps, label=label)


def calibrated_noise_multiplier(sample_rate: float, steps: int, target_epsilon: float, delta: float) -> float:
    """The smallest noise multiplier z whose secure charge stays within ``target_epsilon``."""
    return skellam_multiplier_for_epsilon(lambda z: secure_charge(sample_rate, z, steps, "calibration"),
                                          target_epsilon, delta)


# Opacus's RDP accountant's orders (its DEFAULT_ALPHAS: the first 150 of ours) and bisection
# settings, so a target ε gives exactly the σ Opacus's ``get_noise_multiplier`` would.
OPACUS_ORDERS = DEFAULT_ORDERS[:150]
OPACUS_MAX_SIGMA = 1e6
CALIBRATION_TOLERANCE = 0.005  # ε below the target by at most this much


def _opacus_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """ε of Opacus's RDP accountant: its orders, Balle et al. 2020's conversion, NaNs skipped."""
    rdp = sampled_gaussian_rdp(OPACUS_ORDERS, sample_rate, noise_multiplier, steps)
    lam = OPACUS_ORDERS
    eps = rdp - (np.log(delta) + np.log(lam)) / (lam - 1) + np.log((lam - 1) / lam)
    return float(eps[np.nanargmin(eps)])


def gaussian_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, epochs: int) -> float:
    """The σ Opacus's ``get_noise_multiplier`` (RDP accountant) returns for these settings:
    double σ until ε ≤ target, then bisect until ε is within the tolerance below it."""
    steps = int(epochs / sample_rate)  # as Opacus counts them (the schedule's own count may differ by rounding)
    eps_high, sigma_low, sigma_high = math.inf, 0.0, 10.0
    while eps_high > target_epsilon:
        sigma_high *= 2
        eps_high = _opacus_epsilon(sigma_high, sample_rate, steps, delta)
        if sigma_high > OPACUS_MAX_SIGMA:
            raise InvalidValue(f"target_epsilon {target_epsilon:g} needs a noise multiplier above {OPACUS_MAX_SIGMA:g}")
    while target_epsilon - eps_high > CALIBRATION_TOLERANCE:
        sigma = (sigma_low + sigma_high) / 2
        eps = _opacus_epsilon(sigma, sample_rate, steps, delta)
        if eps < target_epsilon:
            sigma_high, eps_high = sigma, eps
        else:
            sigma_low = sigma
    return sigma_high
