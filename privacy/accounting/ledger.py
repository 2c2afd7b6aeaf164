"""The durable privacy budget of a run: every charge, checked against a Rényi filter, on disk first.

One SQLite file per run, one row per charge (label, RDP curve, extra δ, unbounded flag and
reason, neighbouring relation, time). The file is in WAL mode with ``synchronous=FULL``, so
a committed charge has been fsynced before ``charge`` returns — and callers release answers
only after it returns, so a crash can never forget something that was released.

One writer, many readers. Opening a ``PrivacyLedger`` takes an exclusive lock on the sidecar
file ``<ledger>.lock`` (``flock``, released at ``close`` or by the OS when the process dies);
a second opener — another process, or the same one — fails at once with ``LedgerInUse``.
Two writers would each check the budget against what they alone had charged. Readers
(``read_ledger``, ``conclave analyze --ledger``) take no lock and read a consistent snapshot
while the writer runs. Check-and-commit is atomic across the writer's threads (a lock); a
refused charge writes nothing.

The ledger defends its contents: the settings in ``meta`` carry a checksum, and every charge
row a SHA-256 chained to the row before it (the first to the settings' checksum), over every
stored field and the answers written with it. Answers recorded without a charge (paid for by
an earlier one) are chained the same way in rows of their own (``answer_batches``). Ids run
1, 2, 3… and SQLite's ``sqlite_sequence`` remembers the last one issued, so a deleted row
leaves a gap or a short chain. Every read checks the chain, and anything not as written —
an edited or deleted row, edited settings, a truncated file, a file from before the
checksums — raises ``LedgerDamaged``: a budget that cannot be verified is not a budget. The
checksums have no key: they reveal edits, corruption and truncation, not a forger who
recomputes the whole chain. A shorter chain is still a valid one, so a ledger opened with
``keep_record`` (a service's, a run folder's durable one, an owner's) also keeps its length and
last checksum outside the file (``privacy.accounting.ledger_records``), and a file missing,
emptied, replaced or shorter than that record is refused on every open and read.

A budget can change after it was declared only by an entry of the chain (``change_budget``,
``BUDGET_CHANGE``): the owner of the data raising or lowering its lifetime budget. The filter
then refuses past the new limit, and the guarantee the ledger states is the largest budget it
ever declared (a limit lowered after releases were seen stops later charges; it cannot shrink
the bound on what came before).

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

import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import secrets
import sqlite3
import struct
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from conclave.privacy.accounting.charge import ADD_REMOVE, NEIGHBOURING, PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter, order_index
from conclave.privacy.accounting.guarantee import Guarantee, filter_guarantee
from conclave.privacy.accounting.ledger_records import LedgerRecord, LedgerRecords
from conclave.privacy.accounting.pld import GaussianSteps
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp

log = logging.getLogger(__name__)

# One statement each: they run inside the transaction that writes the new file's settings.
_SCHEMA = (
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
_TABLES = ("meta", "charges", "answer_batches", "answers")
BUDGET_CHANGE = "budget-change"  # the label of a chain entry that changes the budget, not a charge
GAUSSIAN_PLAN = "gaussian_plan"  # a charge's details: the Gaussian releases it is made of, for a tighter ε


class BudgetExceeded(Exception):
    """A charge was refused: it would pass the run's privacy budget. Nothing was recorded."""


class LedgerInUse(RuntimeError):
    """Another writer holds the ledger's lock: a ledger has one writer at a time."""


class LedgerDamaged(ValueError):
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
    changes: tuple[BudgetChange, ...] = ()  # the budget's changes since it was declared, in order

    @property
    def epsilon_limit(self) -> float:
        """The budget's ε now (inf for a record-only ledger)."""
        return self.budget.epsilon if self.budget is not None else math.inf

    @property
    def guarantee(self) -> Guarantee | None:
        """The filter's guarantee — at the largest budget it ever declared — or None without a
        budget (the run's planned work must give one)."""
        largest = largest_budget(self.budget, self.changes)
        return None if largest is None else filter_guarantee(largest, self.neighbouring)

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
        # The Gaussian releases of every charge so far, while each was one (``PrivacyCharge.pld``).
        self.plan: tuple[GaussianSteps, ...] | None = ()

    def add(self, row_id: int, label: str, rdp: np.ndarray, extra_delta: float, unbounded: bool,
            plan: tuple[GaussianSteps, ...] | None = None) -> None:
        self.last_id = row_id
        self.count += 1  # charges only: the chain's budget changes move last_id alone
        self.plan = None if self.plan is None or plan is None else self.plan + plan
        self.rdp = self.rdp + rdp
        self.extra_delta += extra_delta
        self.unbounded = self.unbounded or unbounded
        curve, extra, unb = self.by_label.get(label, (np.zeros_like(rdp), 0.0, False))
        self.by_label[label] = (curve + rdp, extra + extra_delta, unb or unbounded)


class PrivacyLedger:
    """Composes every charge of a run, durably, refusing what its budget does not admit.

    ``budget=None`` makes a record-only ledger: it refuses nothing, also not unbounded
    charges (its report then has ``bounded = False``). ``delta`` is the run's δ; with a
    budget it must equal the budget's (as declared: later changes are entries of the file).
    ``keep_record``: keep the file's length and last checksum outside it
    (``ledger_records``), for a ledger that must outlive its process; a file that has such a
    record is checked against it and keeps it, whoever opens it. Raises ``LedgerInUse`` while
    another writer holds the file and ``LedgerDamaged`` when its contents fail their checksums
    or are shorter than its record.
    """

    def __init__(self, path: str | Path, delta: float, budget: RenyiFilter | None = None,
                 neighbouring: str = ADD_REMOVE, orders=DEFAULT_ORDERS, keep_record: bool = False) -> None:
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
        self._db: sqlite3.Connection | None = None
        self.last_refusal: str | None = None  # the latest refusal's line (why a run stopped)
        in_memory = str(path) == ":memory:"
        # An in-memory ledger has no file another writer could open, nor one to keep a record of.
        self._file_lock: IO[str] | None = None if in_memory else _hold_lock(self.path)
        self._records = None if in_memory else LedgerRecords()
        try:
            record = None if self._records is None else self._records.get(self.path)
            if record is not None and record.entries:  # before SQLite could make an empty file a new ledger
                _check_record(self.path, _read_or_none(self.path), record)
            # autocommit mode: transactions are opened explicitly (BEGIN IMMEDIATE for writes).
            self._db = sqlite3.connect(str(self.path), timeout=60.0, isolation_level=None, check_same_thread=False)
            if _table_exists(self._db, "charges") and "checksum" not in _columns(self._db, "charges"):
                raise LedgerDamaged(_predates(self.path))  # before anything below could write to it
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # fsync the WAL on every commit
            with self._transaction():
                contents = self._create_or_check()
            _check_record(self.path, contents, record)
        except BaseException as error:
            self.close()
            damaged = _unreadable(self.path, error)
            if damaged is not None:
                raise damaged from None
            raise
        for row in contents.rows:
            self._totals.add(*row)
        self._totals.last_id = contents.entries
        self._heads = contents.heads
        self.ledger_id = contents.settings["ledger_id"]  # random, fixed at creation: tells this file from a new one
        self.changes: tuple[BudgetChange, ...] = tuple(contents.changes)
        self.budget = current_budget(budget, self.changes)
        self._keep_record = keep_record or record is not None
        self._note_record()

    @classmethod
    def open_existing(cls, path: str | Path, keep_record: bool = False) -> PrivacyLedger:
        """Reopen a ledger file with the settings it was created with (to read or keep charging it)."""
        delta, budget, neighbouring, orders = _declared(path, _read(Path(path)).settings)
        return cls(path, delta, budget, neighbouring=neighbouring, orders=orders, keep_record=keep_record)

    # --- public API -----------------------------------------------------------------------

    def charge(self, charge: PrivacyCharge, worst_case: PrivacyCharge | None = None,
               answers: dict[bytes, int] | None = None) -> BudgetReport:
        """Record ``charge`` (and the ``answers`` it pays for) durably and return the new
        report — or raise BudgetExceeded (recording nothing) when spent + ``worst_case``
        (default: the charge) would pass the budget. Call before releasing anything the
        charge pays for."""
        self._check_charge(charge)
        if charge.label == BUDGET_CHANGE:
            raise ValueError(f"{BUDGET_CHANGE!r} labels the budget's changes, not a charge")
        if worst_case is not None:
            self._check_charge(worst_case)
            if np.any(charge.rdp > worst_case.rdp * (1 + 1e-9) + 1e-15) or charge.extra_delta > worst_case.extra_delta * (
                1 + 1e-9
            ) or (charge.unbounded and not worst_case.unbounded):
                raise ValueError(f"charge {charge.label!r} exceeds the worst case it was checked against")
        rdp = np.asarray(charge.rdp, dtype="<f8")
        with self._lock:
            self._connection()
            try:
                self._refuse_if_over(worst_case if worst_case is not None else charge)
            except BudgetExceeded as refused:
                self.last_refusal = str(refused)
                raise
            row_id = self._totals.last_id + 1
            details = charge.details if charge.pld is None else {**charge.details, GAUSSIAN_PLAN: [
                [step.noise_multiplier, step.count, step.sample_rate] for step in charge.pld]}
            row = (row_id, charge.label, rdp.tobytes(), float(charge.extra_delta), int(charge.unbounded),
                   charge.reason, json.dumps(details, default=str), charge.neighbouring, time.time())
            with self._transaction():
                paid = self._not_on_record(answers or {})
                checksum = _checksum("charge", self._heads.charge, row, paid)
                self._insert("charges (id, label, rdp, extra_delta, unbounded, reason, details, neighbouring, "
                             "created, checksum) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", (*row, checksum), row_id)
                self._connection().executemany(
                    "INSERT INTO answers (key, answer, charge_id) VALUES (?, ?, ?)",
                    [(key, answer, row_id) for key, answer in paid])
            # Only after COMMIT succeeded does the new row enter the running totals.
            self._totals.add(row_id, charge.label, rdp, float(charge.extra_delta), bool(charge.unbounded), charge.pld)
            self._heads = _Heads(checksum, self._heads.batch, self._heads.batches)
            self._note_record()
            return self._report()

    def change_budget(self, epsilon: float) -> BudgetChange:
        """Change the budget's ε from now on (δ, order and reserved δ stay), as an entry of the
        chain: only the data's owner does this (``conclave owner raise`` / ``lower``). The
        filter refuses past the new limit; the guarantee stays the largest budget declared."""
        if self.budget is None:
            raise ValueError(f"ledger {self.path} records only: it has no budget to change")
        new = dataclasses.replace(self.budget, epsilon=float(epsilon))  # a limit with no RDP budget: ValueError
        with self._lock:
            self._connection()
            row_id = self._totals.last_id + 1
            change = BudgetChange(row_id, time.time(), self.budget.epsilon, new.epsilon)
            row = (row_id, BUDGET_CHANGE, np.zeros(self.orders.size, dtype="<f8").tobytes(), 0.0, 0, "",
                   json.dumps({"epsilon": change.epsilon, "previous": change.previous}), self.neighbouring,
                   change.created)
            with self._transaction():
                checksum = _checksum("charge", self._heads.charge, row, [])
                self._insert("charges (id, label, rdp, extra_delta, unbounded, reason, details, neighbouring, "
                             "created, checksum) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", (*row, checksum), row_id)
            self._totals.last_id = row_id
            self._heads = _Heads(checksum, self._heads.batch, self._heads.batches)
            self.budget, self.changes = new, (*self.changes, change)
            self._note_record()
            return change

    def can_afford(self, charge: PrivacyCharge) -> bool:
        """Whether ``charge`` would be accepted now (nothing is recorded)."""
        return self.refusal(charge) is None

    def refusal(self, charge: PrivacyCharge) -> str | None:
        """Why ``charge`` would be refused now, in one line, or None (nothing is recorded)."""
        self._check_charge(charge)
        with self._lock:
            self._connection()
            try:
                self._refuse_if_over(charge)
            except BudgetExceeded as refused:
                self.last_refusal = str(refused)
                return self.last_refusal
            return None

    def report(self) -> BudgetReport:
        with self._lock:
            self._connection()
            return self._report()

    def record_answers(self, answers: dict[bytes, int]) -> None:
        """Record answers whose cost an earlier charge already paid (e.g. inside an open
        stability run), so that a restart repeats them too."""
        with self._lock, self._transaction():
            paid = self._not_on_record(answers)
            if not paid:
                return
            batch_id = self._heads.batches + 1
            row = (batch_id, time.time())
            checksum = _checksum("answer batch", self._heads.batch, row, paid)
            self._insert("answer_batches (id, created, checksum) VALUES (?, ?, ?)", (*row, checksum), batch_id)
            self._connection().executemany("INSERT INTO answers (key, answer, batch_id) VALUES (?, ?, ?)",
                                           [(key, answer, batch_id) for key, answer in paid])
            self._heads = _Heads(self._heads.charge, checksum, batch_id)

    def answers(self) -> dict[bytes, int]:
        """Every answer on record (key → released value), checked against the chain."""
        with self._lock, self._transaction(write=False):
            contents = _verified(self.path, self._connection())
        if contents is None:  # emptied behind the writer's back
            raise LedgerDamaged(_damaged(self.path, "its settings (meta) are missing"))
        return contents.answers

    def spent(self) -> PrivacyCharge:
        """Everything recorded so far as one composed charge (curve, Σ extra δ, unbounded)."""
        with self._lock:
            self._connection()
            totals = self._totals
            return PrivacyCharge(
                self.orders,
                totals.rdp.copy(),
                extra_delta=totals.extra_delta,
                unbounded=totals.unbounded,
                reason="an unbounded charge was recorded" if totals.unbounded else "",
                label="spent",
                neighbouring=self.neighbouring,
                pld=totals.plan if totals.count else None,
            )

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
            if self._file_lock is not None:  # after the connection: the next writer finds the WAL folded in
                self._file_lock.close()  # closing the descriptor drops the flock
                self._file_lock = None

    def __enter__(self) -> PrivacyLedger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError(f"privacy ledger {self.path} is closed")
        return self._db

    def _note_record(self) -> None:
        """Keep the chain's length and last checksum outside the file (after a commit, so a
        record is never ahead of the file it describes)."""
        if self._keep_record and self._records is not None:
            self._records.note(LedgerRecord(str(self.path), self.ledger_id, self._totals.last_id, self._heads.charge))

    class _Txn:
        def __init__(self, db: sqlite3.Connection, write: bool) -> None:
            self.db, self.write = db, write

        def __enter__(self) -> None:
            # IMMEDIATE takes SQLite's write lock now; readers keep their snapshot meanwhile.
            self.db.execute("BEGIN IMMEDIATE" if self.write else "BEGIN")

        def __exit__(self, exc_type, exc, tb) -> None:
            if exc_type is None:
                try:
                    self.db.execute("COMMIT")
                    return
                except sqlite3.Error:
                    self._rollback()
                    raise
            self._rollback()

        def _rollback(self) -> None:
            # SQLite may have rolled back already (a full disk): a second ROLLBACK would raise
            # "no transaction is active" and hide the error that caused it.
            if self.db.in_transaction:
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

    def _create_or_check(self) -> _Contents:
        """Set up a new file with this ledger's settings, or check an existing one: its chain,
        then its settings (a file written with other settings is refused)."""
        db = self._connection()
        if not _table_exists(db, "charges"):
            for statement in _SCHEMA:
                db.execute(statement)
        contents = _verified(self.path, db)
        if contents is None:  # a new file: declare the budget, once
            settings = {**self._settings(), "ledger_id": secrets.token_hex(16)}
            settings["checksum"] = _settings_checksum(settings)
            db.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", settings.items())
            return _Contents(settings, [], {}, _Heads(settings["checksum"], settings["checksum"], 0))
        for key, value in self._settings().items():
            if contents.settings[key] != value:
                raise ValueError(
                    f"ledger {self.path} was created with {key} = {_short(contents.settings[key])}, not "
                    f"{_short(value)}: a budget is declared once, before the run; open the file with the settings "
                    "it was created with, or start a new ledger file"
                )
        return contents

    def _not_on_record(self, answers: dict[bytes, int]) -> list[tuple[bytes, int]]:
        """The answers whose keys are not on record yet (an answer, once released, stays), in
        the order their checksum covers them."""
        db = self._connection()
        fresh = [(key, int(answer)) for key, answer in answers.items()
                 if db.execute("SELECT 1 FROM answers WHERE key = ?", (key,)).fetchone() is None]
        return sorted(fresh, key=lambda item: _field(item[0]))

    def _insert(self, into: str, values: tuple, row_id: int) -> None:
        try:
            self._connection().execute("INSERT INTO " + into, values)
        except sqlite3.IntegrityError:  # only a row this writer did not write can hold the next id
            raise LedgerDamaged(_damaged(self.path, f"row {row_id} of {into.split()[0]} was written by something "
                                                    "other than this ledger while it was open")) from None

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
            changes=self.changes,
        )
        self._cached_report = ((spent.last_id, spent.count), report)
        return report


@dataclass(frozen=True)
class LedgerSnapshot:
    """A ledger file as it stood when read: the settings declared when it was created, and
    its charges composed (in row-id order, as the ledger itself adds them)."""

    path: Path
    ledger_id: str  # random, written when the file was created
    delta: float
    budget: RenyiFilter | None  # None: a record-only ledger, no filter was in force; else the limit now
    neighbouring: str
    orders: np.ndarray
    charges: int
    answers: int  # released answers on record (a labelling service records one per distinct input)
    spent: PrivacyCharge  # every charge composed
    by_label: dict[str, PrivacyCharge]  # each label's charges composed
    entries: int = 0  # rows of the chain: charges and budget changes
    changes: tuple[BudgetChange, ...] = ()

    @property
    def guarantee(self) -> Guarantee | None:
        """The filter's guarantee (its largest budget declared), or None for a record-only ledger."""
        largest = largest_budget(self.budget, self.changes)
        return None if largest is None else filter_guarantee(largest, self.neighbouring)


def read_ledger(path: str | Path) -> LedgerSnapshot:
    """Read a ledger file without writing anything: no file is created where there is none,
    no lock is taken, and a run still charging it is neither blocked nor changed (one read
    transaction). The file's chain is checked as when it is opened for charging.

    Raises FileNotFoundError without a file, LedgerDamaged for a file that fails its checks,
    and ValueError for a file that is not a ledger.
    """
    path = Path(path)
    contents = _read_checked(path)
    delta, budget, neighbouring, orders = _declared(path, contents.settings)
    totals = _Totals(orders.size)
    for row in contents.rows:
        totals.add(*row)

    def composed(rdp: np.ndarray, extra: float, unbounded: bool, label: str, plan=None) -> PrivacyCharge:
        return PrivacyCharge(orders, rdp, extra_delta=extra, unbounded=unbounded,
                             reason="an unbounded charge was recorded" if unbounded else "", label=label,
                             neighbouring=neighbouring, pld=plan)

    return LedgerSnapshot(
        path, contents.settings["ledger_id"], delta, current_budget(budget, contents.changes), neighbouring, orders,
        totals.count, len(contents.answers),
        composed(totals.rdp, totals.extra_delta, totals.unbounded, "spent", totals.plan if totals.count else None),
        {label: composed(*sums, label) for label, sums in totals.by_label.items()},
        contents.entries, tuple(contents.changes),
    )


@dataclass(frozen=True)
class ChargeRecord:
    """One charge as the ledger holds it: what (``label``), when (``created``, seconds since
    the epoch), the tags its caller gave it (``details``: e.g. the run), and its cost."""

    id: int
    label: str
    created: float
    details: dict
    charge: PrivacyCharge


def read_history(path: str | Path) -> list[ChargeRecord]:
    """Every entry of a ledger file's chain — its charges and budget changes (label
    ``BUDGET_CHANGE``, costing nothing) — in order, read without writing or locking, after the
    file's chain has been checked (``read_ledger``'s checks)."""
    path = Path(path)
    contents = _read_checked(path)
    _, _, neighbouring, orders = _declared(path, contents.settings)
    db = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=60.0)
    try:
        rows = db.execute("SELECT id, label, rdp, extra_delta, unbounded, reason, details, created FROM charges "
                          "WHERE id <= ? ORDER BY id", (contents.entries,)).fetchall()
    finally:
        db.close()
    return [ChargeRecord(row_id, label, created, json.loads(details),
                         PrivacyCharge(orders, np.frombuffer(rdp, dtype="<f8"), extra_delta=extra, unbounded=bool(unbounded),
                                       reason=reason, label=label, neighbouring=neighbouring))
            for row_id, label, rdp, extra, unbounded, reason, details, created in rows]


# --- the file's defences: one writer, checksummed rows ------------------------------------


_HELD_LOCKS: weakref.WeakSet[IO[str]] = weakref.WeakSet()  # the writer locks this process holds


def _drop_inherited_locks() -> None:
    """In a forked child: close its copies of the parent's lock files. A flock belongs to the
    open file, which a fork shares: a child outliving its parent would hold the ledger."""
    for handle in list(_HELD_LOCKS):
        handle.close()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def _hold_lock(path: Path) -> IO[str]:
    """The writer's lock: an exclusive flock on ``<ledger>.lock``, held while the returned file
    is open (the OS drops it when the process dies). The file is never deleted: a writer that
    opened it before a deletion would hold a lock nobody else sees."""
    lock_path = path.with_name(path.name + ".lock")
    handle = open(lock_path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip()
        handle.close()
        pid = f" (pid {holder})" if holder.isdigit() else ""
        raise LedgerInUse(f"ledger {path} is in use: another process{pid} holds its lock {lock_path}; "
                          "a ledger has one writer at a time") from None
    except BaseException:
        handle.close()
        raise
    handle.truncate(0)  # the holder's pid, for the line a second opener prints
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    _HELD_LOCKS.add(handle)
    return handle


@dataclass(frozen=True)
class _Heads:
    """Where the next rows chain on: the last checksum of each chain (the settings' checksum
    before a chain's first row) and the answer batches on record."""

    charge: str
    batch: str
    batches: int


@dataclass(frozen=True)
class _Contents:
    """A ledger file's contents, checked."""

    settings: dict[str, str]  # the meta table
    # charges: (id, label, RDP curve, extra δ, unbounded, the Gaussian releases it is made of or None)
    rows: list[tuple[int, str, np.ndarray, float, bool, tuple[GaussianSteps, ...] | None]]
    answers: dict[bytes, int]
    heads: _Heads
    entries: int = 0  # rows of the charge chain: charges and budget changes
    checksums: tuple[str, ...] = ()  # each entry's checksum, by id
    changes: tuple[BudgetChange, ...] = ()


def _read(path: Path) -> _Contents:
    """A ledger file's checked contents, read in one transaction without writing or locking."""
    if not path.is_file():
        raise FileNotFoundError(f"no privacy ledger at {path}")
    try:
        # mode=ro: SQLite never creates or writes the file (PrivacyLedger would set it up for charging).
        db = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=60.0, isolation_level=None)
        try:
            db.execute("BEGIN")
            contents = _verified(path, db)
            db.execute("COMMIT")
        finally:
            db.close()
    except sqlite3.DatabaseError as error:
        damaged = _unreadable(path, error)
        if damaged is not None:
            raise damaged from None
        raise ValueError(f"{path} is not a privacy ledger ({error})") from None
    if contents is None:
        raise ValueError(f"{path} is not a privacy ledger (it declares no settings)")
    return contents


def _verified(path: Path, db: sqlite3.Connection) -> _Contents | None:
    """Everything in the ledger, each row checked against its chain; None for a file with the
    tables but nothing in them yet. Raises LedgerDamaged naming the first thing not as written."""
    if not _table_exists(db, "charges"):
        raise ValueError(f"{path} is not a privacy ledger (it has no charges table)")
    if "checksum" not in _columns(db, "charges"):
        raise LedgerDamaged(_predates(path))
    for table in _TABLES:
        if not _table_exists(db, table):
            raise LedgerDamaged(_damaged(path, f"its {table} table is missing"))
    settings = dict(db.execute("SELECT key, value FROM meta").fetchall())
    # AUTOINCREMENT keeps the last id each table issued: a deleted last row still shows.
    issued = dict(db.execute("SELECT name, seq FROM sqlite_sequence").fetchall())
    if not settings:
        if issued or any(db.execute(f"SELECT EXISTS (SELECT 1 FROM {table})").fetchone()[0] for table in _TABLES):
            raise LedgerDamaged(_damaged(path, "its settings (meta) are missing"))
        return None
    if settings.get("checksum") != _settings_checksum(settings):
        raise LedgerDamaged(_damaged(path, "its settings (meta) do not match their checksum (edited)"))
    if not isinstance(settings.get("ledger_id"), str):
        raise LedgerDamaged(_damaged(path, "its settings (meta) hold no ledger id"))
    size = _declared(path, settings)[3].size

    by_charge: dict[int, list[tuple[bytes, int]]] = defaultdict(list)
    by_batch: dict[int, list[tuple[bytes, int]]] = defaultdict(list)
    answers: dict[bytes, int] = {}
    for key, answer, charge_id, batch_id in db.execute("SELECT key, answer, charge_id, batch_id FROM answers"):
        if (charge_id is None) == (batch_id is None):
            raise LedgerDamaged(_damaged(path, "an answer belongs to no charge, or to two (edited)"))
        (by_charge[charge_id] if batch_id is None else by_batch[batch_id]).append((key, answer))
        answers[key] = answer

    rows, head, checksums, changes = [], settings["checksum"], [], []
    for expected, row in enumerate(db.execute(
            "SELECT id, label, rdp, extra_delta, unbounded, reason, details, neighbouring, created, checksum "
            "FROM charges ORDER BY id"), start=1):
        row_id, label, blob, extra_delta, unbounded = row[:5]
        _check_link(path, "charge", expected, row, head, by_charge.pop(expected, []))
        curve = np.frombuffer(blob, dtype="<f8") if isinstance(blob, bytes) and len(blob) == 8 * size else None
        # +inf is a stored value (an unbounded charge, σ = 0); NaN and negatives never are.
        if curve is None or np.any(np.isnan(curve)) or np.any(curve < 0):
            raise LedgerDamaged(_damaged(path, f"charge {row_id}'s RDP curve is not {size} non-negative numbers"))
        if not (isinstance(extra_delta, float) and 0 <= extra_delta < 1) or unbounded not in (0, 1):
            raise LedgerDamaged(_damaged(path, f"charge {row_id}'s extra delta or unbounded flag is out of range"))
        if label == BUDGET_CHANGE:
            changes.append(_budget_change(path, row, curve, extra_delta, unbounded))
        else:
            rows.append((row_id, label, curve, extra_delta, bool(unbounded), _gaussian_plan(row[6])))
        head = row[-1]
        checksums.append(head)
    _check_end(path, "charge", len(checksums), issued.get("charges", 0), by_charge)

    batch_head, batches = settings["checksum"], 0
    for batches, row in enumerate(db.execute("SELECT id, created, checksum FROM answer_batches ORDER BY id"), start=1):
        _check_link(path, "answer batch", batches, row, batch_head, by_batch.pop(batches, []))
        batch_head = row[-1]
    _check_end(path, "answer batch", batches, issued.get("answer_batches", 0), by_batch)
    return _Contents(settings, rows, answers, _Heads(head, batch_head, batches), len(checksums), tuple(checksums),
                     tuple(changes))


def _gaussian_plan(details: str) -> tuple[GaussianSteps, ...] | None:
    """The Gaussian releases a charge row states it is made of (None: not only Gaussian ones, or
    an older row, or one that does not parse: its RDP curve then stands alone)."""
    try:
        plan = json.loads(details).get(GAUSSIAN_PLAN)
        return None if plan is None else tuple(GaussianSteps(float(z), int(n), float(q)) for z, n, q in plan)
    except (AttributeError, TypeError, ValueError):
        return None


def _budget_change(path: Path, row: tuple, curve: np.ndarray, extra_delta: float, unbounded: int) -> BudgetChange:
    """A chain entry labelled ``BUDGET_CHANGE``: it costs nothing and names the new ε."""
    row_id, created, details = row[0], row[8], row[6]
    try:
        stated = json.loads(details)
        change = BudgetChange(row_id, float(created), float(stated["previous"]), float(stated["epsilon"]))
    except (KeyError, TypeError, ValueError):
        change = None
    if change is None or np.any(curve != 0) or extra_delta != 0 or unbounded or not (
            change.epsilon > 0 and math.isfinite(change.epsilon)):
        raise LedgerDamaged(_damaged(path, f"entry {row_id} is a budget change that does not parse"))
    return change


def current_budget(declared: RenyiFilter | None, changes: tuple[BudgetChange, ...] | list[BudgetChange]
                   ) -> RenyiFilter | None:
    """The limit in force: the budget declared at creation, with its latest change's ε."""
    if declared is None or not changes:
        return declared
    return dataclasses.replace(declared, epsilon=changes[-1].epsilon)


def largest_budget(budget: RenyiFilter | None, changes: tuple[BudgetChange, ...]) -> RenyiFilter | None:
    """The largest budget a ledger ever declared (``budget`` being the one now): its guarantee."""
    if budget is None or not changes:
        return budget
    return dataclasses.replace(budget, epsilon=max(budget.epsilon, *(c.previous for c in changes)))


def _read_or_none(path: Path) -> _Contents | None:
    """A file's checked contents for comparing with its record; None when there is no file or
    no ledger in it (deleted, emptied to 0 bytes)."""
    try:
        return _read(path)
    except FileNotFoundError:
        return None
    except LedgerDamaged:
        raise
    except ValueError:  # not a ledger (an empty file has no tables)
        return None


def _read_checked(path: Path) -> _Contents:
    """``_read``, and for a file with a record, checked against it first: a missing or emptied
    file is then refused as such, not read as no ledger."""
    record = LedgerRecords().get(path)
    if record is None or not record.entries:
        return _read(path)
    contents = _read_or_none(path)
    _check_record(path, contents, record)
    return contents


def _check_record(path: Path, contents: _Contents | None, record: LedgerRecord | None) -> None:
    """Refuse (``LedgerDamaged``) a file that is missing, emptied, replaced or shorter than its
    record says, or whose recorded entry is not the one recorded."""
    if record is None or record.entries == 0:
        return
    recorded = f"its record (kept outside the file) says it held {record.entries} entries"
    if contents is None:
        what = "it is missing" if not path.exists() else "it is empty"
        raise LedgerDamaged(_damaged(path, f"{what}, but {recorded}; a deleted or emptied ledger is not a fresh "
                                           "budget: restore the file"))
    if contents.settings["ledger_id"] != record.ledger_id:
        raise LedgerDamaged(_damaged(path, f"it is another file than the one recorded, and {recorded}; a new ledger "
                                           "is not a fresh budget: restore the original"))
    if contents.entries < record.entries:
        raise LedgerDamaged(_damaged(path, f"it holds {contents.entries} entries but {recorded}; a shortened ledger "
                                           "is not a fresh budget: restore the full file"))
    if contents.checksums[record.entries - 1] != record.head:
        raise LedgerDamaged(_damaged(path, f"its entry {record.entries} is not the one its record saw (rewritten)"))


def _check_link(path: Path, kind: str, expected: int, row: tuple, previous: str,
                answers: list[tuple[bytes, int]]) -> None:
    """Row ``expected`` of a chain: there, and its checksum over ``previous``, its fields and its answers."""
    if row[0] != expected:
        raise LedgerDamaged(_damaged(path, f"{kind} {expected} is missing (deleted)"))
    answers.sort(key=lambda item: _field(item[0]))
    if row[-1] != _checksum(kind, previous, row[:-1], answers):
        raise LedgerDamaged(_damaged(path, f"{kind} {expected}'s checksum does not match (edited or truncated)"))


def _check_end(path: Path, kind: str, count: int, issued: int, orphans: dict[int, list]) -> None:
    """A chain's end: as many rows as ids were issued, and no answers pointing past them."""
    if issued > count:
        raise LedgerDamaged(_damaged(path, f"{kind} {count + 1} is missing (deleted or truncated)"))
    if issued != count:
        raise LedgerDamaged(_damaged(path, f"it holds {count} {kind} rows but issued {issued} ids (edited)"))
    if orphans:
        raise LedgerDamaged(_damaged(path, f"answers point at {kind} {min(orphans)}, which is not in the ledger"))


def _checksum(kind: str, previous: str, fields: tuple, answers: list[tuple[bytes, int]]) -> str:
    """SHA-256 over the chain's previous checksum, a row's stored fields and the answers
    written with it (sorted by key)."""
    digest = hashlib.sha256(_field(kind) + _field(previous) + _field(len(answers)))
    for value in fields:
        digest.update(_field(value))
    for key, answer in answers:
        digest.update(_field(key) + _field(answer))
    return digest.hexdigest()


def _settings_checksum(settings: dict[str, str]) -> str:
    """SHA-256 over the meta table but its own checksum: the root of both chains."""
    digest = hashlib.sha256(_field("settings"))
    for key, value in sorted(((k, v) for k, v in settings.items() if k != "checksum"), key=lambda kv: _field(kv[0])):
        digest.update(_field(key) + _field(value))
    return digest.hexdigest()


def _field(value: object) -> bytes:
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


def _table_exists(db: sqlite3.Connection, table: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone() is not None


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def _unreadable(path: Path, error: BaseException) -> LedgerDamaged | None:
    """SQLite's own finding that the file is damaged, as one line; None for anything else
    (e.g. a busy or missing file)."""
    code = (getattr(error, "sqlite_errorcode", None) or 0) & 0xFF
    if code == sqlite3.SQLITE_CORRUPT:
        return LedgerDamaged(_damaged(path, f"SQLite cannot read it ({error})"))
    if code == sqlite3.SQLITE_NOTADB:  # a header overwritten, or another kind of file
        return LedgerDamaged(f"ledger {path} is damaged or is not a privacy ledger: SQLite cannot read it "
                             f"({error}); refusing to use it")
    return None


def _damaged(path: Path, what: str) -> str:
    return f"ledger {path} is damaged: {what}; refusing to use it"


def _predates(path: Path) -> str:
    return (f"ledger {path} predates checksums: its charges cannot be verified, and a budget that cannot be "
            "verified is not a budget; refusing to use it")


def _declared(path: Path, stored: dict[str, str]) -> tuple[float, RenyiFilter | None, str, np.ndarray]:
    """(δ, budget, neighbouring relation, orders) from a ledger's meta table."""
    try:
        budget = json.loads(stored["budget"])
        declared = (float(json.loads(stored["delta"])), None if budget is None else RenyiFilter(**budget),
                    stored["neighbouring"], np.asarray(json.loads(stored["orders"]), dtype=float))
    except (KeyError, TypeError, ValueError) as error:
        raise LedgerDamaged(_damaged(path, f"its settings (meta) do not parse ({type(error).__name__}: {error})"))
    if declared[3].ndim != 1 or declared[3].size == 0:
        raise LedgerDamaged(_damaged(path, "its settings (meta) declare no list of RDP orders"))
    return declared


def _short(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."
