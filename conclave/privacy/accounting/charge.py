"""The unit every phase of a run pays with: a privacy charge on one grid of RDP orders.

Rényi DP (Mironov 2017) composes by adding curves order by order, so a charge is an RDP
curve aligned with the ledger's orders. Mechanisms whose guarantee is (ε, δ) rather than
RDP (e.g. the sparse-vector stability mechanism) carry their pure part as an RDP curve
and their δ in ``extra_delta``; δ's add up under basic composition. A mechanism with no
finite guarantee (NZC as published) is marked ``unbounded``: it can be reported but never
charged to a ledger with a finite limit.

Every charge names the neighbouring relation its bound holds for. Bounds for add/remove
and replace-one neighbours do not compose as if they were the same, so a ledger accepts
only charges under its own relation (vote mechanisms are analysed for one teacher's vote
changing; an ensemble whose shards are a function of each record turns that into
add/remove, see ``for_records``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting.pld import GaussianSteps


class Neighbouring(StrEnum):
    """The neighbouring relations a bound can hold for; the value is how reports and ledgers name it."""

    ADD_REMOVE = "add-remove"
    REPLACE_ONE = "replace-one"
    ONE_VOTE = "one-vote"

    @property
    def meaning(self) -> str:
        """What changes between two neighbouring datasets."""
        return {
            Neighbouring.ADD_REMOVE: "one record added or removed",
            Neighbouring.REPLACE_ONE: "one record replaced by another",
            Neighbouring.ONE_VOTE: "one teacher's vote moves to another class (the vote histogram's neighbours)",
        }[self]

    @classmethod
    def of(cls, value: str) -> Neighbouring:
        """The relation named ``value`` (``ValueError``, one line naming them all, if none is)."""
        try:
            return cls(value)
        except ValueError:
            known = sorted(n.value for n in cls)
            raise InvalidValue(f"unknown neighbouring relation {value!r}; one of {known}") from None


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
        neighbouring: the relation the bound holds for.
        pld: the Gaussian releases the charge is made of, when it is nothing else
            (``privacy.accounting.pld``: a tighter (ε, δ) for work fixed in advance); None otherwise.
    """

    orders: np.ndarray
    rdp: np.ndarray
    extra_delta: float = 0.0
    unbounded: bool = False
    reason: str = ""
    label: str = ""
    details: dict = field(default_factory=dict, compare=False)
    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE
    pld: tuple[GaussianSteps, ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "neighbouring", Neighbouring.of(self.neighbouring))
        orders = np.asarray(self.orders, dtype=float)
        rdp = np.asarray(self.rdp, dtype=float)
        if orders.ndim != 1 or rdp.shape != orders.shape:
            raise InvalidValue(f"rdp {rdp.shape} must align with orders {orders.shape}")
        if np.any(orders <= 1):
            raise InvalidValue("RDP orders must be > 1")
        if np.any(rdp < 0) or np.any(np.isnan(rdp)):
            raise InvalidValue("RDP values must be non-negative numbers")
        if self.extra_delta < 0:
            raise InvalidValue("extra_delta must be non-negative")
        object.__setattr__(self, "orders", orders)
        object.__setattr__(self, "rdp", rdp)

    @property
    def is_free(self) -> bool:
        """True when the charge costs nothing at any order (nothing need be recorded)."""
        return not self.unbounded and self.extra_delta == 0 and not np.any(self.rdp)

    def scaled(self, count: int) -> PrivacyCharge:
        """``count`` independent repetitions of this release (RDP composition, Mironov 2017, Prop. 1;
        δ's add up); zero repetitions cost nothing."""
        if count < 0:
            raise InvalidValue(f"count must be >= 0, got {count}")
        if count == 0:
            return replace(self, rdp=np.zeros_like(self.rdp), extra_delta=0.0, unbounded=False, reason="", pld=())
        pld = None if self.pld is None else tuple(step.times(count) for step in self.pld)
        return replace(self, rdp=count * self.rdp, extra_delta=count * self.extra_delta, pld=pld)

    def for_records(self, relation: Neighbouring, why: str) -> PrivacyCharge:
        """This one-vote charge restated for record-level neighbours ``relation``.

        Valid when changing one record under ``relation`` changes at most one teacher's vote;
        ``why`` states the lemma (e.g. shards assigned by a keyed hash of each record).
        """
        if self.neighbouring != Neighbouring.ONE_VOTE:
            raise InvalidValue(f"charge {self.label!r} holds for '{self.neighbouring}', not for one vote")
        if not why:
            raise InvalidValue("restating a vote-level charge for records must say why it holds")
        return replace(self, neighbouring=relation, details={**self.details, "neighbouring_lemma": why})
