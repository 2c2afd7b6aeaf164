"""Where DP noise comes from: OS entropy, always, unless a run asks loudly for the opposite.

The experiment seed never decides noise: anyone holding the repository could replay it. Every
process that draws noise gets a ``NoiseSource`` from a ``NoisePolicy``; released numbers use
exact samplers (OpenDP). ``insecure_seed`` (tests, debugging) and ``noise_scale`` (the broken
build an audit must catch) mark every report ``sound: false``. docs/privacy.md, "Where noise
comes from".
"""
from __future__ import annotations

import functools
import secrets
import zlib
from dataclasses import dataclass

import numpy as np
from conclave.errors import InvalidValue

INSECURE_REASON = (
    "DP noise was drawn from the public seed privacy.insecure_noise_seed={seed}: anyone with the seed "
    "can replay and subtract it, so no epsilon holds for this run"
)
BROKEN_REASON = "noise deliberately scaled by {scale:g} for an audit test: the epsilon claimed is not the one drawn"


@dataclass(frozen=True)
class NoisePolicy:
    """How a run draws DP noise; picklable, so actors build their own sources from it."""

    insecure_seed: int | None = None  # None: OS entropy (the only sound choice)
    noise_scale: float = 1.0  # test-only: DP-SGD draws σ·noise_scale, charged at σ (module docstring)

    def __post_init__(self) -> None:
        if not 0.0 <= self.noise_scale < float("inf"):
            raise InvalidValue(f"noise_scale must be finite and >= 0, got {self.noise_scale!r}")

    @property
    def sound(self) -> bool:
        return self.insecure_seed is None and self.noise_scale == 1.0

    @property
    def unsound_reason(self) -> str | None:
        reasons = ([] if self.insecure_seed is None else [INSECURE_REASON.format(seed=self.insecure_seed)]) + (
            [] if self.noise_scale == 1.0 else [BROKEN_REASON.format(scale=self.noise_scale)])
        return "; ".join(reasons) or None

    def source(self, stream: str) -> NoiseSource:
        """A fresh source for one named use (``stream``, e.g. "aggregator", "dp-pca").

        With OS entropy every call is independent. With an insecure seed the stream name
        picks the sub-stream, so callers must name each release differently.
        """
        if self.insecure_seed is None:
            return NoiseSource(np.random.Generator(np.random.PCG64DXSM(secrets.randbits(256))), secure=True,
                               noise_scale=self.noise_scale)
        sequence = np.random.SeedSequence(entropy=self.insecure_seed, spawn_key=(zlib.crc32(stream.encode()),))
        return NoiseSource(np.random.Generator(np.random.PCG64DXSM(sequence)), secure=False,
                           noise_scale=self.noise_scale)


SECURE = NoisePolicy()


class NoiseSource:
    """One process's DP noise for one use; see the module docstring."""

    def __init__(self, rng: np.random.Generator, secure: bool, noise_scale: float = 1.0) -> None:
        self.rng = rng
        self.secure = secure
        self.noise_scale = noise_scale  # the policy's test-only factor; read by ``train_dp`` alone

    def seed(self) -> int:
        """A 63-bit seed for another generator (e.g. torch's): from the OS when secure."""
        return secrets.randbits(63) if self.secure else int(self.rng.integers(0, 2**63 - 1))

    def laplace_counts(self, counts: np.ndarray, scale: float) -> np.ndarray:
        """Integer ``counts`` plus discrete Laplace noise, P(z) ∝ exp(−|z|/scale): ε = Δ₁/scale."""
        values = np.asarray(counts)
        if not np.issubdtype(values.dtype, np.integer) or values.ndim != 1:
            raise InvalidValue(f"expected a 1-D integer vector of counts, got {values.dtype} {values.shape}")
        if not scale > 0:
            raise InvalidValue(f"scale must be > 0, got {scale}")
        if self.secure:
            return np.asarray(_opendp_laplace_ints(float(scale))(values.astype(np.int64).tolist()), dtype=np.int64)
        # Difference of two geometric variables is discrete Laplace (insecure path only).
        p = -np.expm1(-1.0 / scale)
        return values.astype(np.int64) + self.rng.geometric(p, values.shape) - self.rng.geometric(p, values.shape)

    def gaussian(self, values: np.ndarray, sigma: float) -> np.ndarray:
        """Float ``values`` plus N(0, σ²) noise, sampled exactly and rounded once (no low-bit leak)."""
        array = np.asarray(values, dtype=np.float64)
        if not np.isfinite(array).all():
            raise InvalidValue("values to be released must be finite")
        if not sigma > 0:
            raise InvalidValue(f"sigma must be > 0, got {sigma}")
        if self.secure:
            flat = _opendp_gaussian_floats(float(sigma))(array.reshape(-1).tolist())
            return np.asarray(flat, dtype=np.float64).reshape(array.shape)
        return array + self.rng.normal(0.0, sigma, size=array.shape)


# OpenDP measurements are built once per scale; building one costs more than a small release.
# Its modules are imported one by one: ``opendp.prelude`` also imports scikit-learn, pandas and
# polars (seconds in every process that draws its first noise).


@functools.lru_cache(maxsize=64)
def _opendp_laplace_ints(scale: float):
    from opendp.domains import atom_domain, vector_domain
    from opendp.measurements import make_laplace
    from opendp.metrics import l1_distance
    from opendp.mod import enable_features

    enable_features("contrib")
    return make_laplace(vector_domain(atom_domain(T=int)), l1_distance(T=int), scale=scale)


@functools.lru_cache(maxsize=64)
def _opendp_gaussian_floats(sigma: float):
    from opendp.domains import atom_domain, vector_domain
    from opendp.measurements import make_gaussian
    from opendp.metrics import l2_distance
    from opendp.mod import enable_features

    enable_features("contrib")
    return make_gaussian(vector_domain(atom_domain(T=float, nan=False)), l2_distance(T=float), scale=sigma)
