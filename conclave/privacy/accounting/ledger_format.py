"""A ledger file's format: its tables, its entries, and the checksums that chain them.

Every row carries a SHA-256 chained to the row before (the first to the settings' checksum), over
its fields and the answers written with it; ``ledger_check`` reads a file against them and
``ledger_store`` writes it. The checksums have no key: they catch edits and damage, not a forger.
"""
from __future__ import annotations

import hashlib
import json
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from conclave.errors import RunRefused
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter
from conclave.privacy.accounting.pld import GaussianSteps

# One statement each: they run inside the transaction that writes the new file's settings.
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS charges (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- 1, 2, 3...: a gap is a deleted row
    label TEXT NOT NULL,
    rdp BLOB NOT NULL,            -- little-endian float64 curve on the ledger's orders
    extra_delta REAL NOT NULL,
    unbounded INTEGER NOT NULL,
    reason TEXT NOT NULL,
    details TEXT NOT NULL,        -- JSON, for people reading the file
    neighbouring TEXT NOT NULL,
    created REAL NOT NULL,        -- seconds since the epoch
    checksum TEXT NOT NULL        -- SHA-256 over the row before's checksum, this row and its answers
)""",
    """CREATE TABLE IF NOT EXISTS answer_batches (  -- answers recorded without a charge, chained alike
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created REAL NOT NULL,
    checksum TEXT NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS answers (  -- what was released, so a restart answers repeats alike
    key BLOB PRIMARY KEY,                -- e.g. a hash of the input
    answer INTEGER NOT NULL,
    charge_id INTEGER REFERENCES charges (id),       -- the charge that paid for it, or
    batch_id INTEGER REFERENCES answer_batches (id), -- paid for earlier (a stability run's opening charge)
    CHECK ((charge_id IS NULL) != (batch_id IS NULL))
)""",
)
TABLES = ("meta", "charges", "answer_batches", "answers")
BUDGET_CHANGE = "budget-change"  # the label of a chain entry that changes the budget, not a charge
GAUSSIAN_PLAN = "gaussian_plan"  # a charge's details: the Gaussian releases it is made of, for a tighter ε
WORST_CASE = "worst_case"  # a charge's details: the worst case it was checked against, where it is more


class LedgerDamaged(RunRefused, ValueError):
    """The ledger file is not as its writer left it (edited, truncated, corrupt, or older than
    checksums), or is shorter than its record says: its budget cannot be trusted, so it is not used."""


@dataclass(frozen=True)
class BudgetChange:
    """A budget changed after it was declared: entry ``entry`` of the chain, at ``created``
    (seconds since the epoch), from ε ``previous`` to ε ``epsilon`` (δ and order unchanged)."""

    entry: int
    created: float
    previous: float
    epsilon: float

    @property
    def raised(self) -> bool:
        return self.epsilon > self.previous

    def as_dict(self) -> dict:
        return {"entry": self.entry, "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.created)),
                "from_epsilon": self.previous, "to_epsilon": self.epsilon,
                "change": "raised" if self.raised else "lowered"}


@dataclass(frozen=True)
class LedgerSettings:
    """What a ledger declares when its file is created: written into ``meta`` and fixed for the
    file's life (the budget as declared; later changes are entries of the chain)."""

    delta: float
    budget: RenyiFilter | None
    neighbouring: Neighbouring
    orders: np.ndarray

    def meta(self) -> dict[str, str]:
        """The settings as stored (and compared, text for text, when the file is reopened)."""
        return {
            "orders": json.dumps(self.orders.tolist()),
            "delta": json.dumps(self.delta),
            "neighbouring": str(self.neighbouring),
            "budget": json.dumps(None if self.budget is None else {
                "epsilon": self.budget.epsilon, "delta": self.budget.delta, "order": self.budget.order,
                "reserved_delta": self.budget.reserved_delta}),
        }

    @classmethod
    def stored(cls, path: Path, meta: dict[str, str]) -> LedgerSettings:
        """The settings a file's ``meta`` declares (``LedgerDamaged`` when they do not parse)."""
        try:
            budget = json.loads(meta["budget"])
            settings = cls(float(json.loads(meta["delta"])), None if budget is None else RenyiFilter(**budget),
                           Neighbouring.of(meta["neighbouring"]), np.asarray(json.loads(meta["orders"]), dtype=float))
        except (KeyError, TypeError, ValueError) as error:
            raise LedgerDamaged(damaged(path, f"its settings (meta) do not parse ({type(error).__name__}: {error})"))
        if settings.orders.ndim != 1 or settings.orders.size == 0:
            raise LedgerDamaged(damaged(path, "its settings (meta) declare no list of RDP orders"))
        return settings


@dataclass(frozen=True)
class StoredCharge:
    """A charge as its row holds it, with the Gaussian releases it states it is made of (None:
    not only Gaussian ones, or an older row) and the worst case it was checked against (None:
    the charge is its own worst case)."""

    label: str
    rdp: np.ndarray
    extra_delta: float
    unbounded: bool
    plan: tuple[GaussianSteps, ...] | None
    worst: WorstCase | None = None


@dataclass(frozen=True)
class WorstCase:
    """The data-independent worst case a charge was checked against, where it exceeds the
    charge (e.g. every query of a batch answered, where some abstained)."""

    rdp: np.ndarray
    extra_delta: float
    unbounded: bool

    @classmethod
    def beyond(cls, charge: PrivacyCharge, worst_case: PrivacyCharge | None) -> WorstCase | None:
        """``worst_case`` where it differs from ``charge`` (None where it does not, or there is none)."""
        if worst_case is None or (np.array_equal(worst_case.rdp, charge.rdp) and worst_case.extra_delta ==
                                  charge.extra_delta and worst_case.unbounded == charge.unbounded):
            return None
        return cls(np.asarray(worst_case.rdp, dtype="<f8"), float(worst_case.extra_delta), bool(worst_case.unbounded))

    def as_details(self) -> dict:
        return {"rdp": self.rdp.tolist(), "extra_delta": self.extra_delta, "unbounded": self.unbounded}


@dataclass(frozen=True)
class StoredEntry:
    """One row of the chain as stored: a charge or a budget change (``BUDGET_CHANGE``)."""

    id: int
    label: str
    rdp: np.ndarray
    extra_delta: float
    unbounded: bool
    reason: str
    details: dict
    created: float


@dataclass(frozen=True)
class Heads:
    """Where the next rows chain on: the last checksum of each chain (the settings' checksum
    before a chain's first row) and the answer batches on record."""

    charge: str
    batch: str
    batches: int


@dataclass(frozen=True)
class StoredLedger:
    """A ledger file's contents, checked."""

    meta: dict[str, str]  # the settings as stored, with the file's identity and checksum
    charges: list[StoredCharge]  # in row-id order
    answers: dict[bytes, int]
    heads: Heads
    entries: int = 0  # rows of the charge chain: charges and budget changes
    checksums: tuple[str, ...] = ()  # each entry's checksum, by id
    changes: tuple[BudgetChange, ...] = ()

    @property
    def ledger_id(self) -> str:
        return self.meta["ledger_id"]


def chain_checksum(kind: str, previous: str, fields: tuple, answers: list[tuple[bytes, int]]) -> str:
    """SHA-256 over the chain's previous checksum, a row's stored fields and the answers
    written with it (sorted by key)."""
    digest = hashlib.sha256(field_bytes(kind) + field_bytes(previous) + field_bytes(len(answers)))
    for value in fields:
        digest.update(field_bytes(value))
    for key, answer in answers:
        digest.update(field_bytes(key) + field_bytes(answer))
    return digest.hexdigest()


def settings_checksum(settings: dict[str, str]) -> str:
    """SHA-256 over the meta table but its own checksum: the root of both chains."""
    digest = hashlib.sha256(field_bytes("settings"))
    for key, value in sorted(((k, v) for k, v in settings.items() if k != "checksum"),
                             key=lambda kv: field_bytes(kv[0])):
        digest.update(field_bytes(key) + field_bytes(value))
    return digest.hexdigest()


def field_bytes(value: object) -> bytes:
    """One SQLite value as unambiguous bytes: its type, its length, its contents."""
    if value is None:
        tag, raw = b"n", b""
    elif isinstance(value, bytes):
        tag, raw = b"b", value
    elif isinstance(value, str):
        tag, raw = b"s", value.encode()
    elif isinstance(value, float):
        tag, raw = b"f", struct.pack("<d", value + 0.0)  # SQLite stores -0.0 as 0.0
    elif isinstance(value, int):
        tag, raw = b"i", str(value).encode()
    else:
        raise TypeError(f"a ledger stores no {type(value).__name__}")
    return tag + struct.pack("<Q", len(raw)) + raw


def damaged(path: Path, what: str) -> str:
    return f"ledger {path} is damaged: {what}; refusing to use it"


def predates_checksums(path: Path) -> str:
    return (f"ledger {path} predates checksums: its charges cannot be verified, and a budget that cannot be "
            "verified is not a budget; refusing to use it")

