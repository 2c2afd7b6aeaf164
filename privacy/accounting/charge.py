"""The unit every phase of a run pays with: a privacy charge on one grid of RDP orders.

Rényi DP (Mironov 2017) composes by adding curves order by order, so a charge is an RDP
curve aligned with the ledger's orders. Mechanisms whose guarantee is (ε, δ) rather than
RDP (e.g. the sparse-vector stability mechanism) carry their pure part as an RDP curve
and their δ in ``extra_delta``; δ's add up under basic composition. A mechanism with no
finite guarantee (NZC as published) is marked ``unbounded``: it can be reported but never
charged to a ledger with a finite limit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class PrivacyCharge:
    """What one release costs.

    Attributes:
        orders: the RDP orders λ (> 1) the curve is given at.
        rdp: RDP ε(λ) at each order (same length as ``orders``).
        extra_delta: δ spent outside the RDP curve (basic composition adds it to the total δ).
        unbounded: True when no finite DP guarantee holds (e.g. NZC); ``rdp`` is then +inf.
        reason: one line saying why a charge is unbounded (empty otherwise).
        label: what was charged, e.g. "gnmax", "threshold", "dpsgd-epoch-3".
    """

    orders: np.ndarray
    rdp: np.ndarray
    extra_delta: float = 0.0
    unbounded: bool = False
    reason: str = ""
    label: str = ""
    details: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        orders = np.asarray(self.orders, dtype=float)
        rdp = np.asarray(self.rdp, dtype=float)
        if orders.ndim != 1 or rdp.shape != orders.shape:
            raise ValueError(f"rdp {rdp.shape} must align with orders {orders.shape}")
        if np.any(orders <= 1):
            raise ValueError("RDP orders must be > 1")
        if np.any(rdp < 0) or np.any(np.isnan(rdp)):
            raise ValueError("RDP values must be non-negative numbers")
        if self.extra_delta < 0:
            raise ValueError("extra_delta must be non-negative")
        object.__setattr__(self, "orders", orders)
        object.__setattr__(self, "rdp", rdp)
