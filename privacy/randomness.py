"""Where noise comes from.

Experiments pass a seed so runs can be repeated. Serving passes none: the generator is then
seeded with 256 bits from the operating system's CSPRNG (``secrets``), so noise can be
neither predicted nor replayed. One generator per mechanism instance; noise is never reused.
"""
from __future__ import annotations

import secrets

import numpy as np


def make_rng(seed: int | None) -> np.random.Generator:
    """A seeded generator for experiments, or an OS-entropy-seeded one when ``seed`` is None."""
    if seed is None:
        return np.random.Generator(np.random.PCG64DXSM(secrets.randbits(256)))
    return np.random.Generator(np.random.PCG64DXSM(seed))
