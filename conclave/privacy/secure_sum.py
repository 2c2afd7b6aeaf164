"""Secure sum of owners' vectors with distributed Skellam noise: whoever sums sees only a noised total.

Every cross-owner sum (DP-SGD steps, DP-PCA, NearPrivate's counts) runs in rounds: each party
quantizes its vector, adds its Skellam noise share and pairwise masks (X25519, HKDF, ChaCha20)
that cancel mod the ring. ``SecureSumPlan`` fixes the scale, ring and noise shares from public
figures. A round missing a share must be aborted. Sensitivities, noise shares, ring and sampler:
docs/privacy.md, "Quantized secure sum".
"""
from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from conclave.errors import InvalidValue
from conclave.privacy.noise import NoiseSource

logger = logging.getLogger(__name__)

INT64_LIMIT = 2**63  # an int64 all-reduce of W values in [0, m) must stay below this
MAX_MODULUS_BITS = 62  # m ≤ 2^62 divides 2^64, so a uniform uint64 reduced mod m stays uniform
POISSON_LAMBDA_MAX = 2.0**30  # largest λ per Poisson draw (see "Sampler" above)
MAX_POISSON_DRAWS = 1024  # per coordinate and sign; more means the plan asks for absurd noise
SHARE_ROUND_UP = 1 + 2.0**-40  # float sums of shares never fall below μ_total
MASK_CONTEXT = b"conclave/secure-sum/v1"


def bernstein_tail(variance: float, t: float) -> float:
    """``P(|X| ≥ t) ≤ 2·exp(−t²/(2(Var + t/3)))`` for a Skellam X (a difference of Poissons).

    Bernstein's inequality: the Skellam cumulant generating function ``Var·Σ_k s^{2k}/(2k)!`` is
    at most ``Var·s²/(2(1 − s/3))`` for 0 ≤ s < 3 (term by term, since (2k)! ≥ 2·3^{2k−2}),
    and the Chernoff bound on both tails gives the inequality.
    """
    return min(1.0, 2.0 * math.exp(-t * t / (2.0 * (variance + t / 3.0))))


def bernstein_threshold(variance: float, failure: float) -> int:
    """Smallest integer t (up to one) with ``bernstein_tail(variance, t) ≤ failure``.

    Solves ``t² − (2L/3)t − 2L·Var = 0`` with ``L = ln(2/failure)``.
    """
    log_term = math.log(2.0 / failure)
    root = log_term / 3.0 + math.sqrt(log_term**2 / 9.0 + 2.0 * log_term * variance)
    return math.ceil(root) + 1  # +1 covers the float error of the root


@dataclass(frozen=True)
class SecureSumPlan:
    """Ring, quantization and noise of a secure sum, fixed from public quantities before any data.

    Inputs: ``dimension`` d, ``parties`` W (ranks taking part), ``owners`` O (distinct owners
    among them), ``norm_bound`` R (L2 bound each party's vector is projected onto),
    ``sensitivity`` c (L2 change of the sum of real vectors when one record is added or removed,
    e.g. the clip bound), ``noise_multiplier`` z (total noise std = z·Δ₂), ``rounds`` and
    ``wrap_probability`` (chance that any coordinate of any round wraps around the ring).
    See the module docstring for the theorems behind each derived field.
    """

    dimension: int
    parties: int
    owners: int
    norm_bound: float
    sensitivity: float
    noise_multiplier: float
    rounds: int = 1
    wrap_probability: float = 2.0**-40
    rounding_inflation: float = 0.05  # γ stops growing once √d ≤ this · γc
    integer_inputs: bool = False  # vectors are integers already (counts): γ = 1, no rounding term

    modulus_bits: int = field(init=False)  # m = 2^modulus_bits, the largest with W·m < 2^63
    scale_bits: int = field(init=False)  # γ = 2^scale_bits
    l2_sensitivity: float = field(init=False)  # Δ₂ in the integer domain
    l1_sensitivity: float = field(init=False)  # Δ₁ in the integer domain
    noise_variance: float = field(init=False)  # μ_total = (z·Δ₂)²: what every owner faces from the others
    owner_variance: float = field(init=False)  # what each owner adds, over all its parties
    outsider_variance: float = field(init=False)  # the whole total's noise: what whoever sums faces
    wrap_bound: int = field(init=False)  # |noise| < wrap_bound on every coordinate of every round, w.p. ≥ 1 − β

    def __post_init__(self) -> None:
        self._validate()
        modulus_bits = max(b for b in range(1, MAX_MODULUS_BITS + 1) if self.parties * 2**b < INT64_LIMIT)
        object.__setattr__(self, "modulus_bits", modulus_bits)
        target = 0 if self.integer_inputs else self._target_scale_bits()
        fitting = [g for g in range(target, -1, -1) if self._fits(g)]
        if not fitting:
            needed = (2 * (self._max_abs_total(0) + 1) - 1).bit_length()
            raise InvalidValue(
                f"secure sum of a vector of d={self.dimension} (norm bound {self.norm_bound}, noise multiplier "
                f"{self.noise_multiplier}) with W={self.parties} parties needs {needed} bits at scale 1; "
                f"the ring has {modulus_bits} (W·m < 2^63)")
        if fitting[0] < target:
            logger.warning("the ring of %d bits caps the quantization scale at 2^%d (wanted 2^%d): rounding "
                           "inflates the noise by %.1f%%", modulus_bits, fitting[0], target,
                           100 * math.sqrt(self.dimension) / (2 ** fitting[0] * self.sensitivity))
        self._set_noise(fitting[0])
        draws = math.ceil(self.owner_variance / 2 / POISSON_LAMBDA_MAX)
        if draws > MAX_POISSON_DRAWS:
            raise InvalidValue(f"noise variance {self.owner_variance:.3g} per owner needs {draws} Poisson draws per "
                             f"coordinate (at most {MAX_POISSON_DRAWS}); lower the noise multiplier or raise "
                             "rounding_inflation")

    @property
    def modulus(self) -> int:
        return 1 << self.modulus_bits

    @property
    def scale(self) -> int:
        """γ, the quantization scale (a power of two)."""
        return 1 << self.scale_bits

    @property
    def max_abs_total(self) -> int:
        """Bound on |total| (quantized values plus noise) that holds w.p. ≥ 1 − β; it is < m/2."""
        return self._max_abs_total(self.scale_bits)

    def party_variances(self, owner_of: Sequence[Hashable]) -> tuple[float, ...]:
        """Noise variance of each party's share, given the owner of each rank (``owner_of[rank]``).

        Each owner's ``owner_variance`` is split evenly across its parties.
        """
        if len(owner_of) != self.parties:
            raise InvalidValue(f"owner_of names {len(owner_of)} parties, the plan has {self.parties}")
        if len(set(owner_of)) != self.owners:
            raise InvalidValue(f"owner_of names {len(set(owner_of))} owners, the plan has {self.owners}")
        counts = {owner: list(owner_of).count(owner) for owner in set(owner_of)}
        return tuple(self.owner_variance / counts[owner] for owner in owner_of)

    def _validate(self) -> None:
        for name in ("dimension", "parties", "owners", "rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidValue(f"{name} must be a positive integer, got {value!r}")
        if self.owners > self.parties:
            raise InvalidValue(f"owners ({self.owners}) cannot outnumber parties ({self.parties})")
        for name in ("norm_bound", "sensitivity", "noise_multiplier", "rounding_inflation"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise InvalidValue(f"{name} must be a positive finite number, got {value!r}")
        if not 0 < self.wrap_probability < 1:
            raise InvalidValue(f"wrap_probability must be in (0, 1), got {self.wrap_probability}")
        if self.dimension * 8 > 64 * 2**32:
            raise InvalidValue(f"dimension {self.dimension} exceeds one ChaCha20 stream (2^35 entries)")

    def _target_scale_bits(self) -> int:
        """Smallest g with √d ≤ rounding_inflation · 2^g · c."""
        ratio = math.sqrt(self.dimension) / (self.rounding_inflation * self.sensitivity)
        return max(0, math.ceil(math.log2(ratio)))

    def _noise(self, scale_bits: int) -> tuple[float, float, float, float, float]:
        """(Δ₂, Δ₁, μ_total, per-owner variance, outsider variance) at γ = 2^scale_bits."""
        d, c = self.dimension, self.sensitivity
        if self.integer_inputs:
            l2, l1 = c, min(math.sqrt(d) * c, c * c)  # integer x: ‖x‖₁ ≤ ‖x‖₂²
        else:
            l2 = 2**scale_bits * c + math.sqrt(d)
            l1 = math.sqrt(d) * l2
        total = (self.noise_multiplier * l2) ** 2
        per_owner = total * SHARE_ROUND_UP / max(self.owners - 1, 1)
        return l2, l1, total, per_owner, per_owner * self.owners

    def _max_abs_total(self, scale_bits: int) -> int:
        outsider = self._noise(scale_bits)[4]
        noise = bernstein_threshold(outsider, self.wrap_probability / (self.rounds * self.dimension))
        return self.parties * (math.ceil(2**scale_bits * self.norm_bound) + 1) + noise

    def _fits(self, scale_bits: int) -> bool:
        return self._max_abs_total(scale_bits) <= (1 << (self.modulus_bits - 1)) - 1

    def _set_noise(self, scale_bits: int) -> None:
        l2, l1, total, per_owner, outsider = self._noise(scale_bits)
        outsider_tail = bernstein_threshold(outsider, self.wrap_probability / (self.rounds * self.dimension))
        for name, value in (("scale_bits", scale_bits), ("l2_sensitivity", l2), ("l1_sensitivity", l1),
                            ("noise_variance", total), ("owner_variance", per_owner),
                            ("outsider_variance", outsider), ("wrap_bound", outsider_tail)):
            object.__setattr__(self, name, value)


# Every plan of a real-valued sum picks γ with √d ≤ rounding_inflation·γc, so Δ₂ = γc + √d ≥ 21√d ≥ 21:
# each term of the Skellam bound (Cor. 3.6) at μ = (z·Δ₂)² is then at most its value at Δ₁ = Δ₂ = 21,
# the curve a charge can use before d is known (learning.secure_dpsgd, privacy.pca.SecureAnalyzeGauss).
DOMINATING_SENSITIVITY = 1 + 1 / SecureSumPlan.rounding_inflation


def project(v: np.ndarray, radius: float) -> np.ndarray:
    """Euclidean projection onto the L2 ball of ``radius`` (non-expansive: a convex set's projection)."""
    norm = float(np.linalg.norm(v))
    return v * (radius / norm) if norm > radius else v


def quantize(v: np.ndarray, plan: SecureSumPlan) -> np.ndarray:
    """One party's vector in the integer domain: project onto the R-ball, scale by γ, round to nearest."""
    array = np.asarray(v)
    if array.shape != (plan.dimension,):
        raise InvalidValue(f"expected a vector of shape ({plan.dimension},), got {array.shape}")
    if plan.integer_inputs:
        if not np.issubdtype(array.dtype, np.integer):
            raise InvalidValue(f"the plan expects integer vectors, got {array.dtype}")
        return array.astype(np.int64)
    array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise InvalidValue("the vector to be summed must be finite")
    return np.rint(project(array, plan.norm_bound) * plan.scale).astype(np.int64)


def skellam_noise(shape: int | tuple[int, ...], variance: float,
                  rng: np.random.Generator | NoiseSource) -> np.ndarray:
    """Integer Skellam noise Poisson(variance/2) − Poisson(variance/2), from the caller's generator.

    Each Poisson is drawn as a sum of equal Poissons of parameter ≤ 2^30 (a sum of independent
    Poissons is Poisson): numpy refuses λ ≳ 9.2·10^18, and its float acceptance test loses
    precision as λ grows (module docstring). ``rng`` must be seeded from OS entropy
    (``NoisePolicy.source``) for the noise to count.
    """
    generator = rng.rng if isinstance(rng, NoiseSource) else rng
    if not (math.isfinite(variance) and variance >= 0):
        raise InvalidValue(f"variance must be a finite number ≥ 0, got {variance}")
    lam = variance / 2
    draws = max(1, math.ceil(lam / POISSON_LAMBDA_MAX))
    if draws > MAX_POISSON_DRAWS:
        raise InvalidValue(f"variance {variance:.3g} needs {draws} Poisson draws per coordinate "
                         f"(at most {MAX_POISSON_DRAWS})")
    noise = np.zeros(shape, dtype=np.int64)
    for _ in range(draws):
        noise += generator.poisson(lam / draws, shape)
        noise -= generator.poisson(lam / draws, shape)
    return noise


class PairwiseMasks:
    """One party's masks for one session: the pair keys it shares with every peer.

    The mask of a round is Σ_{j>i} s_ij − Σ_{j<i} s_ij mod m, where s_ij is ChaCha20 keyed with the
    pair key of (i, j), nonce = the round number, read as little-endian uint64 and reduced mod m.
    Rounds must strictly increase: a mask used twice would reveal the difference of two vectors.
    """

    def __init__(self, rank: int, pair_keys: dict[int, bytes]) -> None:
        self.rank = rank
        self.pair_keys = pair_keys
        self._last_round = -1

    @property
    def parties(self) -> int:
        return len(self.pair_keys) + 1

    def mask(self, round_number: int, plan: SecureSumPlan) -> np.ndarray:
        """This party's mask for ``round_number``, as int64 in [0, m); refuses a round already used."""
        if not isinstance(round_number, int) or not 0 <= round_number < 2**64:
            raise InvalidValue(f"round must be an integer in [0, 2^64), got {round_number!r}")
        if round_number <= self._last_round:
            raise InvalidValue(f"round {round_number} is not after round {self._last_round}: masks are never reused")
        if self.parties != plan.parties:
            raise InvalidValue(f"these masks are for {self.parties} parties, the plan has {plan.parties}")
        self._last_round = round_number
        total = np.zeros(plan.dimension, dtype=np.uint64)
        for peer, key in self.pair_keys.items():
            stream = _mask_stream(key, round_number, plan.dimension)
            if peer > self.rank:
                total += stream  # uint64 arithmetic wraps mod 2^64, and m divides 2^64
            else:
                total -= stream
        return (total & np.uint64(plan.modulus - 1)).astype(np.int64)


def _mask_stream(key: bytes, round_number: int, dimension: int) -> np.ndarray:
    # cryptography's 16-byte ChaCha20 nonce: a 4-byte block counter (0), then the 12-byte nonce.
    nonce = (0).to_bytes(4, "little") + round_number.to_bytes(8, "little") + bytes(4)
    encryptor = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()
    return np.frombuffer(encryptor.update(bytes(8 * dimension)), dtype="<u8")


class MaskKeys:
    """A party's X25519 key pair for one session (Bonawitz et al. 2017, key agreement).

    Publish ``public_bytes``; once every rank's public key is known, ``pairwise_masks`` derives
    the pair key of each peer with HKDF-SHA256 over the X25519 shared secret, its info binding
    the session string and both (rank, public key) pairs in rank order, so both sides agree. Use
    one session string per sequence of rounds (e.g. run id and purpose), fresh key pairs per session.
    The private key comes from the OS (via OpenSSL) and never leaves this object.
    """

    def __init__(self, rank: int, private_key: X25519PrivateKey | None = None) -> None:
        if not isinstance(rank, int) or rank < 0:
            raise InvalidValue(f"rank must be a non-negative integer, got {rank!r}")
        self.rank = rank
        self._private_key = private_key if private_key is not None else X25519PrivateKey.generate()
        self.public_bytes = self._private_key.public_key().public_bytes_raw()

    def pairwise_masks(self, public_keys: Sequence[bytes], session: str) -> PairwiseMasks:
        """Pair keys with every other rank, given ``public_keys[rank]`` for all ranks (this one included)."""
        if not session:
            raise InvalidValue("session must name this sequence of rounds (e.g. run id and purpose)")
        if self.rank >= len(public_keys) or public_keys[self.rank] != self.public_bytes:
            raise InvalidValue(f"public_keys[{self.rank}] is not this party's public key")
        if len(set(public_keys)) != len(public_keys):
            raise InvalidValue("two ranks published the same public key")
        pair_keys = {}
        for peer, peer_public in enumerate(public_keys):
            if peer == self.rank:
                continue
            secret = self._private_key.exchange(X25519PublicKey.from_public_bytes(peer_public))
            low, high = sorted(((self.rank, self.public_bytes), (peer, peer_public)))
            fields = (MASK_CONTEXT, session.encode(), low[0].to_bytes(4, "big"), low[1], high[0].to_bytes(4, "big"),
                      high[1])
            info = b"".join(len(f).to_bytes(4, "big") + f for f in fields)  # length-prefixed: unambiguous
            pair_keys[peer] = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)
        return PairwiseMasks(self.rank, pair_keys)


def masked_share(v_int: np.ndarray, noise_int: np.ndarray, masks: PairwiseMasks, plan: SecureSumPlan,
                 round_number: int) -> np.ndarray:
    """What a party sends: (v + noise + mask) mod m as int64 in [0, m); uniform on Z_m on its own."""
    values, noise = np.asarray(v_int), np.asarray(noise_int)
    for name, array in (("v_int", values), ("noise_int", noise)):
        if array.shape != (plan.dimension,) or not np.issubdtype(array.dtype, np.integer):
            raise InvalidValue(f"{name} must be an integer vector of shape ({plan.dimension},), "
                             f"got {array.dtype} {array.shape}")
    share = values.astype(np.int64).view(np.uint64) + noise.astype(np.int64).view(np.uint64)
    share += masks.mask(round_number, plan).view(np.uint64)  # two's complement: all of this is mod 2^64
    return (share & np.uint64(plan.modulus - 1)).astype(np.int64)


def decode_integers(total: np.ndarray, plan: SecureSumPlan) -> np.ndarray:
    """The summed shares reduced mod m and mapped to signed integers in [−m/2, m/2)."""
    reduced = np.asarray(total, dtype=np.int64) & (plan.modulus - 1)
    return np.where(reduced >= plan.modulus // 2, reduced - plan.modulus, reduced)


def decode(total: np.ndarray, plan: SecureSumPlan) -> np.ndarray:
    """The noised sum in real units: signed decoding of the summed shares, divided by γ."""
    return decode_integers(total, plan).astype(np.float64) / plan.scale


def secure_sum(vectors: Sequence[np.ndarray], plan: SecureSumPlan, rngs: Sequence[np.random.Generator | NoiseSource],
               masks: Sequence[PairwiseMasks], round_number: int, owner_of: Sequence[Hashable]) -> np.ndarray:
    """Reference run of one round in one process (tests): every party quantizes, draws its noise
    share, masks; the int64 shares are summed as the all-reduce would; the total is decoded."""
    if not len(vectors) == len(rngs) == len(masks) == plan.parties:
        raise InvalidValue(f"expected {plan.parties} vectors, generators and masks, got "
                         f"{len(vectors)}, {len(rngs)}, {len(masks)}")
    if [m.rank for m in masks] != list(range(plan.parties)):
        raise InvalidValue("masks[rank] must be the masks of that rank")
    variances = plan.party_variances(owner_of)
    total = np.zeros(plan.dimension, dtype=np.int64)
    for party in range(plan.parties):
        noise = skellam_noise(plan.dimension, variances[party], rngs[party])
        total += masked_share(quantize(vectors[party], plan), noise, masks[party], plan, round_number)
    return decode(total, plan)
