"""One-round DP releases of a sum across parties through the secure sum (DP-PCA, NearPrivate's counts).

Each party sends one masked share of its part, with its Skellam noise share, under key pairs made
for this release alone; whoever adds the shares decodes only the noised total. A missing share
means nothing is released. The charge is fixed by the noise multiplier alone: docs/privacy.md,
"One-round secure releases".
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.rdp import epsilon_from_rdp
from conclave.privacy.accounting.skellam import skellam_rdp
from conclave.privacy.noise import NoiseSource
from conclave.privacy.secure_sum import MaskKeys, PairwiseMasks, SecureSumPlan, masked_share, quantize, skellam_noise

RELEASE_ROUND = 0  # a release is the only round of its session (fresh key pairs every release)
CALIBRATION_PRECISION = 1e-6  # relative width of the bracket the bisection stops at


def skellam_multiplier_for_epsilon(charge_of: Callable[[float], PrivacyCharge], epsilon: float,
                                   delta: float) -> float:
    """Smallest noise multiplier z (to a relative 10⁻⁶, rounded up) whose ``charge_of(z)`` gives
    ε ≤ ``epsilon`` at ``delta``.

    Every Skellam charge here falls as z grows (each term of Cor. 3.6 does at μ = (z·Δ₂)²), so
    bisection on a bracket applies, as ``learning.dp_schedule.calibrated_noise_multiplier``.
    """
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise InvalidValue(f"epsilon must be a positive finite number, got {epsilon}")
    if not 0 < delta < 1:
        raise InvalidValue(f"delta must be in (0, 1), got {delta}")

    def epsilon_of(z: float) -> float:
        charge = charge_of(z)
        return epsilon_from_rdp(charge.orders, charge.rdp, delta)[0]

    low, high = 1e-3, 1.0
    while epsilon_of(high) > epsilon:
        low, high = high, high * 2
        if high > 1e6:
            raise InvalidValue(f"no noise multiplier up to 1e6 reaches epsilon {epsilon} at delta {delta}")
    while high / low > 1 + CALIBRATION_PRECISION:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if epsilon_of(middle) > epsilon else (low, middle)
    return high


@dataclass(frozen=True)
class CalibratedRelease:
    """A one-round Skellam release whose noise multiplier is the smallest that keeps its charge
    within ``epsilon`` at ``delta``; subclasses say what the charge is at a multiplier z."""

    epsilon: float
    delta: float
    orders: np.ndarray | None = None
    noise_multiplier: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier",
                           skellam_multiplier_for_epsilon(self._charge_at, self.epsilon, self.delta))

    def _charge_at(self, noise_multiplier: float) -> PrivacyCharge:
        raise NotImplementedError

    def charge(self) -> PrivacyCharge:
        """The Skellam RDP curve of one release (charge the ledger with this before releasing)."""
        return self._charge_at(self.noise_multiplier)


def release_plan(charge: PrivacyCharge, *, dimension: int, owners: Sequence[str], norm_bound: float,
                 noise_multiplier: float, integer_inputs: bool, what: str, sensitivity: float = 1.0,
                 rounds: int = 1) -> SecureSumPlan:
    """The secure sum of ``rounds`` rounds, refused if one round would cost more than ``charge``
    (the base curve a charge is built on; subsampling and composition only keep the order).

    ``owners[rank]`` is each party's owner (public); ``norm_bound`` bounds each party's vector
    (public: from the declared records), used only to size the ring.
    """
    plan = SecureSumPlan(dimension=dimension, parties=len(owners), owners=len(set(owners)), norm_bound=norm_bound,
                         sensitivity=sensitivity, noise_multiplier=noise_multiplier, rounds=rounds,
                         integer_inputs=integer_inputs)
    cost = skellam_rdp(charge.orders, plan.l1_sensitivity, plan.l2_sensitivity, plan.noise_variance)
    if np.any(cost > charge.rdp * (1 + 1e-12)):
        raise InvalidValue(f"{what}: the secure sum of {dimension} entries over {len(owners)} parties fits its ring "
                         f"only at scale 2^{plan.scale_bits}, where it would cost more than its charge; "
                         "declare fewer records")
    return plan


class ReleaseKeys:
    """A party's key pairs for its next release, made on request and handed out once, so that no
    two releases share masks (for the actors that take part: shard actors, teacher groups).

    A release takes the pair whose public half its parties hold. A threaded actor may run a key
    request left over from an abandoned release (an owner that hung, then came back) after the
    next release's own request: that pair is dropped, never used in place of the fresh one."""

    _mask_keys: dict[bytes, MaskKeys] | None = None

    def mask_key(self, rank: int) -> bytes:
        """A fresh X25519 key pair for the next secure sum, as rank ``rank``; its public half."""
        keys = MaskKeys(rank)
        with _KEYS_LOCK:
            self._mask_keys = {**(self._mask_keys or {}), keys.public_bytes: keys}
        return keys.public_bytes

    def _take_mask_keys(self, public_keys: Sequence[bytes]) -> MaskKeys:
        """The key pair of this release (its public half is in ``public_keys``); every pair made so
        far is forgotten, so that no later sum reuses one."""
        with _KEYS_LOCK:
            made, self._mask_keys = self._mask_keys or {}, None
        for public in public_keys:
            if public in made:
                return made[public]
        raise RuntimeError("no fresh mask key for this release: call mask_key(rank) before each secure sum")


_KEYS_LOCK = threading.Lock()  # an actor's calls may run on two threads


def party_share(vector: np.ndarray, plan: SecureSumPlan, owners: Sequence[str], masks: PairwiseMasks,
                noise: NoiseSource) -> np.ndarray:
    """What party ``masks.rank`` sends: its vector quantized, plus its Skellam noise share, masked."""
    variance = plan.party_variances(owners)[masks.rank]
    noise_share = skellam_noise(plan.dimension, variance, noise)
    return masked_share(quantize(vector, plan), noise_share, masks, plan, RELEASE_ROUND)


def summed_shares(shares: Sequence[np.ndarray], plan: SecureSumPlan) -> np.ndarray:
    """The int64 sum of one share per party (W·m < 2^63: no overflow); refuses a missing share."""
    if len(shares) != plan.parties:
        raise InvalidValue(f"expected one share from each of the {plan.parties} parties, got {len(shares)}: "
                         "without every share the total is noise, so nothing is released")
    stacked = np.asarray(shares)
    if stacked.shape != (plan.parties, plan.dimension) or not np.issubdtype(stacked.dtype, np.integer):
        raise InvalidValue(f"expected {plan.parties} integer shares of length {plan.dimension}, got "
                         f"{stacked.dtype} {stacked.shape}")
    if stacked.min() < 0 or stacked.max() >= plan.modulus:
        raise InvalidValue("a share lies outside the ring [0, m)")
    return stacked.astype(np.int64).sum(axis=0)
