"""The durable privacy budget of a run: every charge, composed, checked, and on disk first.

One SQLite file per run, one row per charge (label, RDP curve, extra δ, unbounded flag and
reason, time). The file is in WAL mode with ``synchronous=FULL``, so a committed charge
has been fsynced before ``charge`` returns — and callers release answers only after it
returns, so a crash can never forget something that was released.

Check-and-commit is atomic across threads (a lock) and across processes (an SQLite
``BEGIN IMMEDIATE`` write transaction, inside which rows other processes added are read
first). A refused charge writes nothing.

Accounting: RDP curves add order by order (Mironov 2017, Prop. 1). ε is reported with the
tight conversion (Balle et al. 2020, Thm 21). Charges with an ``extra_delta`` (δ-approximate
mechanisms such as the stability mechanism) spend that δ outside the curve, so the
configured δ is split: the curve is converted at δ_rdp = δ − Σ extra_delta and the total
is δ_rdp + Σ extra_delta = δ. A charge that would make Σ extra_delta ≥ δ is refused.
"""
from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from privacy.accounting.charge import PrivacyCharge
from privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS charges (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    label TEXT NOT NULL,
    rdp BLOB NOT NULL,            -- little-endian float64 curve on the ledger's orders
    extra_delta REAL NOT NULL,
    unbounded INTEGER NOT NULL,
    reason TEXT NOT NULL,
    details TEXT NOT NULL,        -- JSON, for people reading the file
    created REAL NOT NULL         -- seconds since the epoch
);
"""


class BudgetExceeded(Exception):
    """A charge was refused: it would pass the run's privacy limit. Nothing was recorded."""


@dataclass(frozen=True)
class BudgetReport:
    epsilon: float  # ε spent so far (inf when an unbounded charge was accepted)
    delta: float  # total δ: curve δ + Σ extra δ (= the configured δ)
    epsilon_limit: float
    order: float | None  # RDP order attaining ε; None when nothing or something unbounded was spent
    charges: int
    sound: bool  # False once an unbounded charge (e.g. NZC) has been recorded
    by_label: dict[str, float]  # ε each label would cost alone, at the same δ split


class _Totals:
    """Running sums of the rows read so far, always added in row-id order so that a reopened
    ledger rebuilds bit-identical totals."""

    def __init__(self, size: int) -> None:
        self.last_id = 0
        self.count = 0
        self.rdp = np.zeros(size)
        self.extra_delta = 0.0
        self.unbounded = False
        self.by_label: dict[str, tuple[np.ndarray, float, bool]] = {}

    def add(self, row_id: int, label: str, rdp: np.ndarray, extra_delta: float, unbounded: bool) -> None:
        self.last_id = row_id
        self.count += 1
        self.rdp = self.rdp + rdp
        self.extra_delta += extra_delta
        self.unbounded = self.unbounded or unbounded
        curve, extra, unb = self.by_label.get(label, (np.zeros_like(rdp), 0.0, False))
        self.by_label[label] = (curve + rdp, extra + extra_delta, unb or unbounded)


class PrivacyLedger:
    """Composes every charge of a run against an (ε, δ) limit, durably.

    ``epsilon_limit=math.inf`` makes a report-only ledger, which also accepts unbounded
    charges (its report then says ε = inf, sound = False). A finite limit refuses them.
    """

    def __init__(self, path: str | Path, epsilon_limit: float, delta: float, orders=DEFAULT_ORDERS) -> None:
        if not (epsilon_limit > 0 and not math.isnan(epsilon_limit)):
            raise ValueError(f"epsilon_limit must be > 0 (or inf for report-only), got {epsilon_limit}")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        self.path = Path(path)
        self.epsilon_limit = float(epsilon_limit)
        self.delta = float(delta)
        self.orders = np.asarray(orders, dtype=float)
        if self.orders.ndim != 1 or self.orders.size == 0 or np.any(self.orders <= 1):
            raise ValueError("orders must be a non-empty 1-D list of numbers > 1")
        self._lock = threading.Lock()
        self._totals = _Totals(self.orders.size)
        # autocommit mode: transactions are opened explicitly with BEGIN IMMEDIATE.
        self._db: sqlite3.Connection | None = sqlite3.connect(
            str(self.path), timeout=60.0, isolation_level=None, check_same_thread=False
        )
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # fsync the WAL on every commit
            self._db.executescript(_SCHEMA)
            with self._transaction():
                self._check_orders()
                self._read_new_rows()
        except Exception:
            self._db.close()
            self._db = None
            raise

    # --- public API -----------------------------------------------------------------------

    def charge(self, charge: PrivacyCharge, worst_case: PrivacyCharge | None = None) -> BudgetReport:
        """Record ``charge`` durably and return the new report — or raise BudgetExceeded
        (recording nothing) when spent + ``worst_case`` (default: the charge) would pass
        the limit. Call before releasing anything the charge pays for."""
        self._check_aligned(charge)
        if worst_case is not None:
            self._check_aligned(worst_case)
            if np.any(charge.rdp > worst_case.rdp * (1 + 1e-9) + 1e-15) or charge.extra_delta > worst_case.extra_delta * (
                1 + 1e-9
            ) or (charge.unbounded and not worst_case.unbounded):
                raise ValueError(f"charge {charge.label!r} exceeds the worst case it was checked against")
        with self._lock:
            with self._transaction():
                self._read_new_rows()
                self._refuse_if_over(worst_case if worst_case is not None else charge)
                self._connection().execute(
                    "INSERT INTO charges (label, rdp, extra_delta, unbounded, reason, details, created) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        charge.label,
                        charge.rdp.astype("<f8").tobytes(),
                        float(charge.extra_delta),
                        int(charge.unbounded),
                        charge.reason,
                        json.dumps(charge.details, default=str),
                        time.time(),
                    ),
                )
            # Only after COMMIT succeeded does the new row enter the running totals.
            self._read_new_rows()
            return self._report()

    def can_afford(self, charge: PrivacyCharge) -> bool:
        """Whether ``charge`` would be accepted now (nothing is recorded)."""
        self._check_aligned(charge)
        with self._lock, self._transaction(write=False):
            self._read_new_rows()
            try:
                self._refuse_if_over(charge)
            except BudgetExceeded:
                return False
            return True

    def report(self) -> BudgetReport:
        with self._lock, self._transaction(write=False):
            self._read_new_rows()
            return self._report()

    def spent(self) -> PrivacyCharge:
        """Everything recorded so far as one composed charge (curve, Σ extra δ, unbounded)."""
        with self._lock, self._transaction(write=False):
            self._read_new_rows()
            totals = self._totals
            return PrivacyCharge(
                self.orders,
                totals.rdp.copy(),
                extra_delta=totals.extra_delta,
                unbounded=totals.unbounded,
                reason="an unbounded charge was recorded" if totals.unbounded else "",
                label="spent",
            )

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def __enter__(self) -> PrivacyLedger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError(f"privacy ledger {self.path} is closed")
        return self._db

    class _Txn:
        def __init__(self, db: sqlite3.Connection, write: bool) -> None:
            self.db, self.write = db, write

        def __enter__(self) -> None:
            # IMMEDIATE takes SQLite's write lock now, so no other process can commit
            # between our read of the totals and our insert.
            self.db.execute("BEGIN IMMEDIATE" if self.write else "BEGIN")

        def __exit__(self, exc_type, exc, tb) -> None:
            if exc_type is None:
                try:
                    self.db.execute("COMMIT")
                    return
                except sqlite3.Error:
                    self.db.execute("ROLLBACK")
                    raise
            self.db.execute("ROLLBACK")

    def _transaction(self, write: bool = True) -> PrivacyLedger._Txn:
        return PrivacyLedger._Txn(self._connection(), write)

    def _check_orders(self) -> None:
        db = self._connection()
        row = db.execute("SELECT value FROM meta WHERE key = 'orders'").fetchone()
        if row is None:
            db.execute("INSERT INTO meta (key, value) VALUES ('orders', ?)", (json.dumps(self.orders.tolist()),))
            return
        stored = np.asarray(json.loads(row[0]), dtype=float)
        if not np.array_equal(stored, self.orders):
            raise ValueError(
                f"ledger {self.path} was written on a different grid of RDP orders "
                f"({stored.size} orders, not {self.orders.size}); open it with the orders it was created with"
            )

    def _read_new_rows(self) -> None:
        rows = self._connection().execute(
            "SELECT id, label, rdp, extra_delta, unbounded FROM charges WHERE id > ? ORDER BY id",
            (self._totals.last_id,),
        )
        for row_id, label, blob, extra_delta, unbounded in rows:
            self._totals.add(row_id, label, np.frombuffer(blob, dtype="<f8"), extra_delta, bool(unbounded))

    def _check_aligned(self, charge: PrivacyCharge) -> None:
        if not np.array_equal(charge.orders, self.orders):
            raise ValueError(f"charge {charge.label!r} is not on this ledger's RDP orders")

    def _epsilon(self, rdp: np.ndarray, extra_delta: float, unbounded: bool) -> tuple[float, float | None]:
        if unbounded or extra_delta >= self.delta:
            return math.inf, None
        epsilon, order = epsilon_from_rdp(self.orders, rdp, self.delta - extra_delta, conversion="tight")
        return epsilon, (None if math.isnan(order) else order)

    def _refuse_if_over(self, charge: PrivacyCharge) -> None:
        spent = self._totals
        if charge.unbounded and math.isfinite(self.epsilon_limit):
            raise BudgetExceeded(
                f"charge {charge.label!r} has no finite privacy guarantee ({charge.reason}); "
                f"refused by a ledger with limit epsilon={self.epsilon_limit}"
            )
        extra = spent.extra_delta + charge.extra_delta
        if extra >= self.delta:
            raise BudgetExceeded(
                f"charge {charge.label!r} would spend delta {extra:.3g} outside the RDP curve, "
                f"not below the limit delta={self.delta:.3g}"
            )
        epsilon, _ = self._epsilon(spent.rdp + charge.rdp, extra, spent.unbounded or charge.unbounded)
        if epsilon > self.epsilon_limit:
            now, _ = self._epsilon(spent.rdp, spent.extra_delta, spent.unbounded)
            raise BudgetExceeded(
                f"charge {charge.label!r} would bring epsilon to {epsilon:.4g} (delta={self.delta:.3g}), "
                f"over the limit {self.epsilon_limit:.4g}; spent so far {now:.4g}"
            )

    def _report(self) -> BudgetReport:
        spent = self._totals
        epsilon, order = self._epsilon(spent.rdp, spent.extra_delta, spent.unbounded)
        by_label = {
            label: self._epsilon(curve, extra, unbounded)[0]
            for label, (curve, extra, unbounded) in spent.by_label.items()
        }
        return BudgetReport(
            epsilon=epsilon,
            delta=self.delta,
            epsilon_limit=self.epsilon_limit,
            order=order,
            charges=spent.count,
            sound=not spent.unbounded,
            by_label=by_label,
        )
