"""The durable privacy budget of a run: every charge, checked against a Rényi filter, on disk first.

One SQLite file per run, one row per charge (label, RDP curve, extra δ, unbounded flag and
reason, neighbouring relation, time). The file is in WAL mode with ``synchronous=FULL``, so
a committed charge has been fsynced before ``charge`` returns — and callers release answers
only after it returns, so a crash can never forget something that was released.

Check-and-commit is atomic across threads (a lock) and across processes (an SQLite
``BEGIN IMMEDIATE`` write transaction, inside which rows other processes added are read
first). A refused charge writes nothing.

The ledger *is* the run's privacy filter (``privacy.accounting.filter``): with a budget it
refuses any charge whose worst case would take the summed RDP at the budget's fixed order
past the RDP budget, or the δ spent outside RDP curves past the reserved δ, or that has no
finite bound at all. The budget, its order, δ, the grid of orders and the neighbouring
relation are written into the file when it is created; reopening with other settings is
refused, because a budget changed mid-run is no longer a budget declared in advance.
Without a budget the ledger refuses nothing and only records (a run's guarantee then comes
from its planned worst case, ``privacy.accounting.guarantee``). ``read_ledger`` reads a file's
declared settings and charges without writing (``conclave analyze --ledger``).

A charge must hold for the ledger's neighbouring relation; add/remove and replace-one bounds
do not compose as one, so a mismatch is an error, not a refusal.

A charge can carry the answers it pays for (key → released value): they are written in the
same transaction, so after a crash either both the charge and its answers are on disk or
neither is, and a restarted service answers a repeated input with what it released before,
at no new cost (``answers()``).

The realised spend (``BudgetReport.epsilon_spent``) composes the charges at their best order
with the tight conversion (Balle et al. 2020, Thm 21), at δ − Σ extra δ. It is a function of
what was released, so it may be shown, but it is an odometer reading, not the guarantee:
only the budget is.
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

from conclave.privacy.accounting.charge import ADD_REMOVE, NEIGHBOURING, PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter, order_index
from conclave.privacy.accounting.guarantee import Guarantee, filter_guarantee
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp

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
    neighbouring TEXT NOT NULL,
    created REAL NOT NULL         -- seconds since the epoch
);
CREATE TABLE IF NOT EXISTS answers (   -- what was released, so a restart answers repeats alike
    key BLOB PRIMARY KEY,              -- e.g. a hash of the input
    answer INTEGER NOT NULL,
    charge_id INTEGER REFERENCES charges (id)  -- NULL: paid for earlier (a stability run's opening charge)
);
"""


class BudgetExceeded(Exception):
    """A charge was refused: it would pass the run's privacy budget. Nothing was recorded."""


@dataclass(frozen=True)
class BudgetReport:
    epsilon_spent: float  # realised spend at its best order (inf once an unbounded charge was accepted)
    delta: float  # total δ: curve δ + Σ extra δ (= the configured δ)
    order: float | None  # RDP order attaining epsilon_spent; None when nothing or something unbounded was spent
    charges: int
    bounded: bool  # False once an unbounded charge (e.g. NZC) has been recorded
    by_label: dict[str, float]  # ε each label would cost alone, at the same δ split
    neighbouring: str
    budget: RenyiFilter | None  # None: a record-only ledger
    rdp_at_budget_order: float | None  # the filter's running sum (None without a budget)
    extra_delta: float  # δ spent outside RDP curves so far

    @property
    def epsilon_limit(self) -> float:
        """The budget's ε (inf for a record-only ledger)."""
        return self.budget.epsilon if self.budget is not None else math.inf

    @property
    def guarantee(self) -> Guarantee | None:
        """The filter's guarantee, or None without a budget (the run's planned work must give one)."""
        return None if self.budget is None else filter_guarantee(self.budget, self.neighbouring)

    @property
    def remaining_rdp(self) -> float | None:
        """What the filter still admits at its order (None without a budget)."""
        if self.budget is None or self.rdp_at_budget_order is None:
            return None
        return max(0.0, self.budget.rdp_budget - self.rdp_at_budget_order)


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
    """Composes every charge of a run, durably, refusing what its budget does not admit.

    ``budget=None`` makes a record-only ledger: it refuses nothing, also not unbounded
    charges (its report then has ``bounded = False``). ``delta`` is the run's δ; with a
    budget it must equal the budget's.
    """

    def __init__(self, path: str | Path, delta: float, budget: RenyiFilter | None = None,
                 neighbouring: str = ADD_REMOVE, orders=DEFAULT_ORDERS) -> None:
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        if budget is not None and budget.delta != delta:
            raise ValueError(f"the budget's delta {budget.delta:g} differs from the ledger's {delta:g}")
        if neighbouring not in NEIGHBOURING:
            raise ValueError(f"unknown neighbouring relation {neighbouring!r}; one of {sorted(NEIGHBOURING)}")
        self.path = Path(path)
        self.delta = float(delta)
        self.budget = budget
        self.neighbouring = neighbouring
        self.orders = np.asarray(orders, dtype=float)
        if self.orders.ndim != 1 or self.orders.size == 0 or np.any(self.orders <= 1):
            raise ValueError("orders must be a non-empty 1-D list of numbers > 1")
        self._budget_index = None if budget is None else order_index(budget.order, self.orders)
        self._lock = threading.Lock()
        self._totals = _Totals(self.orders.size)
        self._cached_report: tuple[tuple[int, int], BudgetReport] | None = None
        # autocommit mode: transactions are opened explicitly with BEGIN IMMEDIATE.
        self._db: sqlite3.Connection | None = sqlite3.connect(
            str(self.path), timeout=60.0, isolation_level=None, check_same_thread=False
        )
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # fsync the WAL on every commit
            self._db.executescript(_SCHEMA)
            with self._transaction():
                self._check_settings()
                self._read_new_rows()
        except Exception:
            self._db.close()
            self._db = None
            raise

    @classmethod
    def open_existing(cls, path: str | Path) -> PrivacyLedger:
        """Reopen a ledger file with the settings it was created with (to read or keep charging it)."""
        if not Path(path).is_file():
            raise FileNotFoundError(f"no privacy ledger at {path}")
        db = sqlite3.connect(str(path))
        try:
            stored = dict(db.execute("SELECT key, value FROM meta").fetchall())
        finally:
            db.close()
        delta, budget, neighbouring, orders = _declared(stored)
        return cls(path, delta, budget, neighbouring=neighbouring, orders=orders)

    # --- public API -----------------------------------------------------------------------

    def charge(self, charge: PrivacyCharge, worst_case: PrivacyCharge | None = None,
               answers: dict[bytes, int] | None = None) -> BudgetReport:
        """Record ``charge`` (and the ``answers`` it pays for) durably and return the new
        report — or raise BudgetExceeded (recording nothing) when spent + ``worst_case``
        (default: the charge) would pass the budget. Call before releasing anything the
        charge pays for."""
        self._check_charge(charge)
        if worst_case is not None:
            self._check_charge(worst_case)
            if np.any(charge.rdp > worst_case.rdp * (1 + 1e-9) + 1e-15) or charge.extra_delta > worst_case.extra_delta * (
                1 + 1e-9
            ) or (charge.unbounded and not worst_case.unbounded):
                raise ValueError(f"charge {charge.label!r} exceeds the worst case it was checked against")
        with self._lock:
            with self._transaction():
                self._read_new_rows()
                self._refuse_if_over(worst_case if worst_case is not None else charge)
                cursor = self._connection().execute(
                    "INSERT INTO charges (label, rdp, extra_delta, unbounded, reason, details, neighbouring, created) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        charge.label,
                        charge.rdp.astype("<f8").tobytes(),
                        float(charge.extra_delta),
                        int(charge.unbounded),
                        charge.reason,
                        json.dumps(charge.details, default=str),
                        charge.neighbouring,
                        time.time(),
                    ),
                )
                if answers:
                    self._connection().executemany(
                        "INSERT OR IGNORE INTO answers (key, answer, charge_id) VALUES (?, ?, ?)",
                        [(key, int(answer), cursor.lastrowid) for key, answer in answers.items()],
                    )
            # Only after COMMIT succeeded does the new row enter the running totals. The
            # transaction read every earlier row and held the write lock, so it is the next one.
            self._totals.add(cursor.lastrowid, charge.label, np.asarray(charge.rdp, dtype="<f8"),
                             float(charge.extra_delta), bool(charge.unbounded))
            return self._report()

    def can_afford(self, charge: PrivacyCharge) -> bool:
        """Whether ``charge`` would be accepted now (nothing is recorded)."""
        self._check_charge(charge)
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

    def record_answers(self, answers: dict[bytes, int]) -> None:
        """Record answers whose cost an earlier charge already paid (e.g. inside an open
        stability run), so that a restart repeats them too."""
        with self._lock, self._transaction():
            self._connection().executemany(
                "INSERT OR IGNORE INTO answers (key, answer, charge_id) VALUES (?, ?, NULL)",
                [(key, int(answer)) for key, answer in answers.items()],
            )

    def answers(self) -> dict[bytes, int]:
        """Every answer recorded with a charge (key → released value)."""
        with self._lock, self._transaction(write=False):
            return dict(self._connection().execute("SELECT key, answer FROM answers").fetchall())

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
                neighbouring=self.neighbouring,
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

    def _settings(self) -> dict[str, str]:
        return {
            "orders": json.dumps(self.orders.tolist()),
            "delta": json.dumps(self.delta),
            "neighbouring": self.neighbouring,
            "budget": json.dumps(None if self.budget is None else {
                "epsilon": self.budget.epsilon, "delta": self.budget.delta, "order": self.budget.order,
                "reserved_delta": self.budget.reserved_delta}),
        }

    def _check_settings(self) -> None:
        """Write the settings into a new file; refuse to reopen a file written with others."""
        db = self._connection()
        stored = dict(db.execute("SELECT key, value FROM meta").fetchall())
        for key, value in self._settings().items():
            if key not in stored:
                db.execute("INSERT INTO meta (key, value) VALUES (?, ?)", (key, value))
            elif stored[key] != value:
                raise ValueError(
                    f"ledger {self.path} was created with {key} = {_short(stored[key])}, not {_short(value)}: "
                    "a budget is declared once, before the run; open the file with the settings it was created "
                    "with, or start a new ledger file"
                )

    def _read_new_rows(self) -> None:
        rows = self._connection().execute(
            "SELECT id, label, rdp, extra_delta, unbounded FROM charges WHERE id > ? ORDER BY id",
            (self._totals.last_id,),
        )
        for row_id, label, blob, extra_delta, unbounded in rows:
            self._totals.add(row_id, label, np.frombuffer(blob, dtype="<f8"), extra_delta, bool(unbounded))

    def _check_charge(self, charge: PrivacyCharge) -> None:
        if not np.array_equal(charge.orders, self.orders):
            raise ValueError(f"charge {charge.label!r} is not on this ledger's RDP orders")
        if charge.neighbouring != self.neighbouring:
            raise ValueError(
                f"charge {charge.label!r} holds for {charge.neighbouring!r} neighbours, this ledger composes "
                f"{self.neighbouring!r}: bounds for different relations do not compose as one"
            )

    def _epsilon(self, rdp: np.ndarray, extra_delta: float, unbounded: bool) -> tuple[float, float | None]:
        if unbounded or extra_delta >= self.delta:
            return math.inf, None
        epsilon, order = epsilon_from_rdp(self.orders, rdp, self.delta - extra_delta, conversion="tight")
        return epsilon, (None if math.isnan(order) else order)

    def _refuse_if_over(self, charge: PrivacyCharge) -> None:
        budget = self.budget
        if budget is None:
            return
        spent = self._totals
        if charge.unbounded:
            raise BudgetExceeded(
                f"charge {charge.label!r} has no finite privacy guarantee ({charge.reason}); "
                f"refused by a ledger with a budget of epsilon={budget.epsilon:g}"
            )
        rdp = float(spent.rdp[self._budget_index] + charge.rdp[self._budget_index])
        extra = spent.extra_delta + charge.extra_delta
        if not budget.admits(rdp, extra):
            if extra > budget.reserved_delta:
                raise BudgetExceeded(
                    f"charge {charge.label!r} would spend delta {extra:.3g} outside the RDP curve, over the "
                    f"{budget.reserved_delta:.3g} reserved for it"
                )
            raise BudgetExceeded(
                f"charge {charge.label!r} would bring RDP at order {budget.order:g} to {rdp:.4g}, over the budget "
                f"{budget.rdp_budget:.4g} (epsilon={budget.epsilon:g} at delta={budget.delta:g}); spent so far "
                f"{float(spent.rdp[self._budget_index]):.4g}"
            )

    def _report(self) -> BudgetReport:
        """The report for the rows read so far; computed once per new row (the conversions to
        ε are most of a read's cost, and a label call reads the budget several times)."""
        spent = self._totals
        if self._cached_report is not None and self._cached_report[0] == (spent.last_id, spent.count):
            return self._cached_report[1]
        epsilon, order = self._epsilon(spent.rdp, spent.extra_delta, spent.unbounded)
        if len(spent.by_label) == 1:  # the one label's sums are the totals, bit for bit
            by_label = dict.fromkeys(spent.by_label, epsilon)
        else:
            by_label = {
                label: self._epsilon(curve, extra, unbounded)[0]
                for label, (curve, extra, unbounded) in spent.by_label.items()
            }
        report = BudgetReport(
            epsilon_spent=epsilon,
            delta=self.delta,
            order=order,
            charges=spent.count,
            bounded=not spent.unbounded,
            by_label=by_label,
            neighbouring=self.neighbouring,
            budget=self.budget,
            rdp_at_budget_order=None if self._budget_index is None else float(spent.rdp[self._budget_index]),
            extra_delta=spent.extra_delta,
        )
        self._cached_report = ((spent.last_id, spent.count), report)
        return report


@dataclass(frozen=True)
class LedgerSnapshot:
    """A ledger file as it stood when read: the settings declared when it was created, and
    its charges composed (in row-id order, as the ledger itself adds them)."""

    path: Path
    delta: float
    budget: RenyiFilter | None  # None: a record-only ledger, no filter was in force
    neighbouring: str
    orders: np.ndarray
    charges: int
    answers: int  # released answers on record (a labelling service records one per distinct input)
    spent: PrivacyCharge  # every charge composed
    by_label: dict[str, PrivacyCharge]  # each label's charges composed

    @property
    def guarantee(self) -> Guarantee | None:
        """The filter's guarantee, or None for a record-only ledger."""
        return None if self.budget is None else filter_guarantee(self.budget, self.neighbouring)


def read_ledger(path: str | Path) -> LedgerSnapshot:
    """Read a ledger file without writing anything: no file is created where there is none,
    and a run still charging it is neither blocked nor changed (one read transaction).

    Raises FileNotFoundError without a file and ValueError for a file that is not a ledger.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no privacy ledger at {path}")
    try:
        # mode=ro: SQLite never creates or writes the file (PrivacyLedger would set it up for charging).
        db = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=60.0, isolation_level=None)
        try:
            db.execute("BEGIN")
            stored = dict(db.execute("SELECT key, value FROM meta").fetchall())
            rows = db.execute("SELECT id, label, rdp, extra_delta, unbounded FROM charges ORDER BY id").fetchall()
            answers = db.execute("SELECT COUNT(*) FROM answers").fetchone()[0]
            db.execute("COMMIT")
        finally:
            db.close()
        delta, budget, neighbouring, orders = _declared(stored)
        totals = _Totals(orders.size)
        for row_id, label, blob, extra_delta, unbounded in rows:
            totals.add(row_id, label, np.frombuffer(blob, dtype="<f8"), extra_delta, bool(unbounded))

        def composed(rdp: np.ndarray, extra: float, unbounded: bool, label: str) -> PrivacyCharge:
            return PrivacyCharge(orders, rdp, extra_delta=extra, unbounded=unbounded,
                                 reason="an unbounded charge was recorded" if unbounded else "", label=label,
                                 neighbouring=neighbouring)

        return LedgerSnapshot(
            path, delta, budget, neighbouring, orders, totals.count, int(answers),
            composed(totals.rdp, totals.extra_delta, totals.unbounded, "spent"),
            {label: composed(*sums, label) for label, sums in totals.by_label.items()},
        )
    except (sqlite3.DatabaseError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path} is not a privacy ledger ({error})") from None


def _declared(stored: dict[str, str]) -> tuple[float, RenyiFilter | None, str, np.ndarray]:
    """(δ, budget, neighbouring relation, orders) from a ledger's meta table."""
    budget = json.loads(stored["budget"])
    return (float(json.loads(stored["delta"])), None if budget is None else RenyiFilter(**budget),
            stored["neighbouring"], np.asarray(json.loads(stored["orders"]), dtype=float))


def _short(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."
