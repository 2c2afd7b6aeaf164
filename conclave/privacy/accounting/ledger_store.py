"""A ledger's durable store: one SQLite file, one writer, every entry chained by checksums.

One row per charge, in WAL mode with ``synchronous=FULL``: a charge is fsynced before
``append_charge`` returns, and callers release only after it returns, so a crash never forgets a
release. The answers a charge pays for go in the same transaction. One writer: opening a store
takes an exclusive ``flock`` on ``<ledger>.lock`` (``LedgerInUse`` for a second opener), since two
writers would each check the budget against what they alone had charged; readers
(``read_stored``) take no lock and read a consistent snapshot.

Every row carries a SHA-256 chained to the row before (the first to the settings' checksum), over
its fields and its answers, and SQLite's ``sqlite_sequence`` remembers the last id issued: an
edited, deleted or truncated row, edited settings or a file older than the checksums is refused
on every read (``LedgerDamaged``). The checksums have no key, and a shorter chain is still a
valid one, so a store opened with ``keep_record`` also keeps its length and last checksum outside
the file (``privacy.accounting.ledger_records``): a file missing, emptied, replaced or shorter
than that record is refused too. An entry's record is written before its commit and put in place
after it, so a record that cannot be written refuses the entry with nothing charged
(``LedgerUnwritable``), and nothing after a commit fails the charge it recorded.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import secrets
import sqlite3
import struct
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from conclave.errors import ConclaveError, InvalidValue, RunRefused
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter
from conclave.privacy.accounting.ledger_records import LedgerRecord, LedgerRecords, StagedRecord
from conclave.privacy.accounting.pld import GaussianSteps

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
_INSERT_ENTRY = ("charges (id, label, rdp, extra_delta, unbounded, reason, details, neighbouring, created, checksum) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
BUDGET_CHANGE = "budget-change"  # the label of a chain entry that changes the budget, not a charge
GAUSSIAN_PLAN = "gaussian_plan"  # a charge's details: the Gaussian releases it is made of, for a tighter ε
WORST_CASE = "worst_case"  # a charge's details: the worst case it was checked against, where it is more


class LedgerInUse(RunRefused, RuntimeError):
    """Another writer holds the ledger's lock: a ledger has one writer at a time."""


class LedgerUnwritable(RunRefused, OSError):
    """The record a ledger keeps outside its file (``ledger_records``) cannot be written (a full
    disk, a file where its folder should be): the entry was refused, nothing was charged."""


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
            raise LedgerDamaged(_damaged(path, f"its settings (meta) do not parse ({type(error).__name__}: {error})"))
        if settings.orders.ndim != 1 or settings.orders.size == 0:
            raise LedgerDamaged(_damaged(path, "its settings (meta) declare no list of RDP orders"))
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
class _Heads:
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
    heads: _Heads
    entries: int = 0  # rows of the charge chain: charges and budget changes
    checksums: tuple[str, ...] = ()  # each entry's checksum, by id
    changes: tuple[BudgetChange, ...] = ()

    @property
    def ledger_id(self) -> str:
        return self.meta["ledger_id"]


class LedgerStore:
    """The file of one ledger, held by this writer (``LedgerInUse`` while another holds it), with
    ``settings`` declared when it is created and checked when it is reopened (other settings are
    refused: a budget is declared once). ``":memory:"`` keeps it in memory, with no lock and no
    record. ``keep_record``: keep the file's length and last checksum outside it; a file that has
    such a record is checked against it and keeps it, whoever opens it. Not thread-safe: its
    ledger serialises the calls. ``opened`` is what the file held when opened."""

    def __init__(self, path: str | Path, settings: LedgerSettings, keep_record: bool = False) -> None:
        self.path = Path(path)
        self.settings = settings
        self._db: sqlite3.Connection | None = None
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
        self.opened = contents
        self.ledger_id = contents.ledger_id  # random, fixed at creation: tells this file from a new one
        self.entries = contents.entries
        self._heads = contents.heads
        self._keep_record = keep_record or record is not None
        self._record_behind = False  # a committed entry's record could not be placed (``_appended``)
        try:
            self._note_record()
        except OSError as error:
            self.close()
            raise self._unwritable(error) from error

    def append_charge(self, charge: PrivacyCharge, answers: dict[bytes, int], worst: WorstCase | None = None) -> None:
        """Write ``charge``, the ``worst`` case it was checked against (where it exceeds the
        charge) and the ``answers`` it pays for (those not on record yet) in one fsynced
        transaction. Raises only with nothing written: its record outside the file is written
        before the commit (``LedgerUnwritable`` when it cannot be), and nothing after the commit
        can fail it."""
        row_id = self.entries + 1
        details = charge.details if charge.pld is None else {**charge.details, GAUSSIAN_PLAN: [
            [step.noise_multiplier, step.count, step.sample_rate] for step in charge.pld]}
        if worst is not None:
            details = {**details, WORST_CASE: worst.as_details()}
        row = (row_id, charge.label, np.asarray(charge.rdp, dtype="<f8").tobytes(), float(charge.extra_delta),
               int(charge.unbounded), charge.reason, json.dumps(details, default=str), charge.neighbouring, time.time())
        self._append_entry(row, answers)

    def append_budget_change(self, previous: float, epsilon: float) -> BudgetChange:
        """Write an entry that changes the budget's ε from ``previous`` to ``epsilon``; it costs nothing."""
        row_id = self.entries + 1
        change = BudgetChange(row_id, time.time(), previous, epsilon)
        row = (row_id, BUDGET_CHANGE, np.zeros(self.settings.orders.size, dtype="<f8").tobytes(), 0.0, 0, "",
               json.dumps({"epsilon": change.epsilon, "previous": change.previous}), self.settings.neighbouring,
               change.created)
        self._append_entry(row, {})
        return change

    def add_answers(self, answers: dict[bytes, int]) -> None:
        """Write answers an earlier charge paid for (those not on record yet) as a batch of their own."""
        with self._transaction():
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
        """Every answer on record (key → released value), read now and checked against the chain."""
        with self._transaction(write=False):
            contents = _verified(self.path, self._connection())
        if contents is None:  # emptied behind the writer's back
            raise LedgerDamaged(_damaged(self.path, "its settings (meta) are missing"))
        return contents.answers

    def check_open(self) -> None:
        """RuntimeError once the store is closed."""
        self._connection()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._file_lock is not None:  # after the connection: the next writer finds the WAL folded in
            self._file_lock.close()  # closing the descriptor drops the flock
            self._file_lock = None

    # --- internals ------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError(f"privacy ledger {self.path} is closed")
        return self._db

    def _append_entry(self, row: tuple, answers: dict[bytes, int]) -> None:
        """Commit chain entry ``row`` (its id first) with the ``answers`` it pays for, its record
        staged before the commit and placed after it: a record that cannot be written refuses
        the entry with nothing written, and what follows the commit cannot fail."""
        row_id, staged = row[0], None
        try:
            if self._record_behind:  # the last entry's record was not placed: in place first, or no entry
                self._note_record()
            with self._transaction():
                paid = self._not_on_record(answers)
                checksum = _checksum("charge", self._heads.charge, row, paid)
                self._insert(_INSERT_ENTRY, (*row, checksum), row_id)
                self._connection().executemany(
                    "INSERT INTO answers (key, answer, charge_id) VALUES (?, ?, ?)",
                    [(key, answer, row_id) for key, answer in paid])
                staged = self._stage_record(row_id, checksum)
        except BaseException as error:
            if staged is not None:  # staged, then the commit failed
                staged.discard()
            if isinstance(error, OSError):
                raise self._unwritable(error) from error
            raise
        self._appended(checksum, staged)

    def _appended(self, checksum: str, staged: StagedRecord | None) -> None:
        """An entry was committed: the chain moves on, and so does its record outside the file.
        Placing the record is a rename in a folder just written; should it fail all the same, the
        entry stands (it is committed) and the record stays one entry behind — which accepts the
        file, never refuses it — until the next entry puts it in place first, or is refused."""
        self.entries += 1
        self._heads = _Heads(checksum, self._heads.batch, self._heads.batches)
        if staged is None:
            return
        try:
            staged.place()
        except OSError as error:
            self._record_behind = True
            log.error("ledger %s: entry %d is committed, but its record %s could not be put in place (%s); the "
                      "next entry puts it in place first, or is refused", self.path, self.entries, staged.target,
                      error)
            return
        self._record_behind = False

    def _stage_record(self, entries: int, head: str) -> StagedRecord | None:
        """The record of the chain at ``entries`` rows ending in ``head``, staged (None: none kept)."""
        if not (self._keep_record and self._records is not None):
            return None
        return self._records.stage(LedgerRecord(str(self.path), self.ledger_id, entries, head))

    def _note_record(self) -> None:
        """Keep the chain's length and last checksum outside the file (after a commit, so a
        record is never ahead of the file it describes)."""
        staged = self._stage_record(self.entries, self._heads.charge)
        if staged is not None:
            staged.place()
            self._record_behind = False

    def _unwritable(self, error: OSError) -> LedgerUnwritable:
        folder = self._records.folder if self._records is not None else self.path.parent
        return LedgerUnwritable(f"ledger {self.path}: its record in {folder} cannot be written "
                                f"({error.strerror or error}); nothing was charged")

    def _transaction(self, write: bool = True) -> _Transaction:
        return _Transaction(self._connection(), write)

    def _create_or_check(self) -> StoredLedger:
        """Set up a new file with these settings, or check an existing one: its chain, then its
        settings (a file written with other settings is refused)."""
        db = self._connection()
        if not _table_exists(db, "charges"):
            for statement in _SCHEMA:
                db.execute(statement)
        contents = _verified(self.path, db)
        declared = self.settings.meta()
        if contents is None:  # a new file: declare the budget, once
            meta = {**declared, "ledger_id": secrets.token_hex(16)}
            meta["checksum"] = _settings_checksum(meta)
            db.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", meta.items())
            return StoredLedger(meta, [], {}, _Heads(meta["checksum"], meta["checksum"], 0))
        for key, value in declared.items():
            if contents.meta[key] != value:
                raise InvalidValue(
                    f"ledger {self.path} was created with {key} = {_short(contents.meta[key])}, not "
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


class _Transaction:
    """One SQLite transaction: committed when the block ends normally, rolled back otherwise."""

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


# --- reading without writing -----------------------------------------------------------


def read_stored(path: Path) -> StoredLedger:
    """A ledger file's checked contents, read in one transaction without writing or locking;
    for a file with a record, checked against it first: a missing or emptied file is then
    refused as such, not read as no ledger. FileNotFoundError without a file, ValueError for a
    file that is not a ledger."""
    record = LedgerRecords().get(path)
    if record is None or not record.entries:
        return _read(path)
    contents = _read_or_none(path)
    _check_record(path, contents, record)
    return contents


def read_entries(path: Path) -> tuple[LedgerSettings, list[StoredEntry]]:
    """A ledger file's settings and every entry of its chain, in order, after ``read_stored``'s checks."""
    contents = read_stored(path)
    settings = LedgerSettings.stored(path, contents.meta)
    db = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=60.0)
    try:
        rows = db.execute("SELECT id, label, rdp, extra_delta, unbounded, reason, details, created FROM charges "
                          "WHERE id <= ? ORDER BY id", (contents.entries,)).fetchall()
    finally:
        db.close()
    return settings, [StoredEntry(row_id, label, np.frombuffer(rdp, dtype="<f8"), extra, bool(unbounded), reason,
                                  json.loads(details), created)
                      for row_id, label, rdp, extra, unbounded, reason, details, created in rows]


def _read(path: Path) -> StoredLedger:
    """A ledger file's checked contents, read in one transaction without writing or locking."""
    if not path.is_file():
        raise FileNotFoundError(f"no privacy ledger at {path}")
    try:
        # mode=ro: SQLite never creates or writes the file (a LedgerStore would set it up for charging).
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
        raise _NotALedger(path, str(error)) from None
    if contents is None:
        raise _NotALedger(path, "it declares no settings")
    return contents


def _read_or_none(path: Path) -> StoredLedger | None:
    """A file's checked contents for comparing with its record; None when there is no file or
    nothing in it (deleted, emptied to 0 bytes). A file with bytes in it that is no ledger, where
    a record says one was, is damaged (a byte flipped in its schema), not empty."""
    try:
        return _read(path)
    except FileNotFoundError:
        return None
    except _NotALedger as error:
        if path.stat().st_size == 0:  # SQLite reads 0 bytes as a database without tables
            return None
        raise LedgerDamaged(_damaged(path, f"it does not read as a privacy ledger ({error.why}), yet a record of "
                                           "it is kept outside the file: restore the file")) from None


def _verified(path: Path, db: sqlite3.Connection) -> StoredLedger | None:
    """Everything in the ledger, each row checked against its chain; None for a file with the
    tables but nothing in them yet. Raises LedgerDamaged naming the first thing not as written."""
    if not _table_exists(db, "charges"):
        raise _NotALedger(path, "it has no charges table")
    if "checksum" not in _columns(db, "charges"):
        raise LedgerDamaged(_predates(path))
    for table in _TABLES:
        if not _table_exists(db, table):
            raise LedgerDamaged(_damaged(path, f"its {table} table is missing"))
    meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
    # AUTOINCREMENT keeps the last id each table issued: a deleted last row still shows.
    issued = dict(db.execute("SELECT name, seq FROM sqlite_sequence").fetchall())
    if not meta:
        if issued or any(db.execute(f"SELECT EXISTS (SELECT 1 FROM {table})").fetchone()[0] for table in _TABLES):
            raise LedgerDamaged(_damaged(path, "its settings (meta) are missing"))
        return None
    if meta.get("checksum") != _settings_checksum(meta):
        raise LedgerDamaged(_damaged(path, "its settings (meta) do not match their checksum (edited)"))
    if not isinstance(meta.get("ledger_id"), str):
        raise LedgerDamaged(_damaged(path, "its settings (meta) hold no ledger id"))
    size = LedgerSettings.stored(path, meta).orders.size

    by_charge: dict[int, list[tuple[bytes, int]]] = defaultdict(list)
    by_batch: dict[int, list[tuple[bytes, int]]] = defaultdict(list)
    answers: dict[bytes, int] = {}
    for key, answer, charge_id, batch_id in db.execute("SELECT key, answer, charge_id, batch_id FROM answers"):
        if (charge_id is None) == (batch_id is None):
            raise LedgerDamaged(_damaged(path, "an answer belongs to no charge, or to two (edited)"))
        (by_charge[charge_id] if batch_id is None else by_batch[batch_id]).append((key, answer))
        answers[key] = answer

    charges, head, checksums, changes = [], meta["checksum"], [], []
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
            charges.append(StoredCharge(label, curve, extra_delta, bool(unbounded), _gaussian_plan(row[6]),
                                        _worst_case(path, row_id, row[6], size)))
        head = row[-1]
        checksums.append(head)
    _check_end(path, "charge", len(checksums), issued.get("charges", 0), by_charge)

    batch_head, batches = meta["checksum"], 0
    for batches, row in enumerate(db.execute("SELECT id, created, checksum FROM answer_batches ORDER BY id"), start=1):
        _check_link(path, "answer batch", batches, row, batch_head, by_batch.pop(batches, []))
        batch_head = row[-1]
    _check_end(path, "answer batch", batches, issued.get("answer_batches", 0), by_batch)
    return StoredLedger(meta, charges, answers, _Heads(head, batch_head, batches), len(checksums), tuple(checksums),
                        tuple(changes))


def _gaussian_plan(details: str) -> tuple[GaussianSteps, ...] | None:
    """The Gaussian releases a charge row states it is made of (None: not only Gaussian ones, or
    an older row, or one that does not parse: its RDP curve then stands alone)."""
    try:
        plan = json.loads(details).get(GAUSSIAN_PLAN)
        return None if plan is None else tuple(GaussianSteps(float(z), int(n), float(q)) for z, n, q in plan)
    except (AttributeError, TypeError, ValueError):
        return None


def _worst_case(path: Path, row_id: int, details: str, size: int) -> WorstCase | None:
    """The worst case a charge row was checked against (None: the charge is its own). Under the
    row's checksum like the rest of it, so one that does not parse is damage, not an older row."""
    try:
        stated = json.loads(details)
        worst = stated.get(WORST_CASE) if isinstance(stated, dict) else None
        if worst is None:
            return None
        curve = np.asarray(worst["rdp"], dtype="<f8")
        extra_delta, unbounded = float(worst["extra_delta"]), worst["unbounded"]
    except (KeyError, TypeError, ValueError) as err:
        raise LedgerDamaged(_damaged(path, f"charge {row_id}'s worst case does not parse ({err})")) from None
    if curve.shape != (size,) or np.any(np.isnan(curve)) or np.any(curve < 0) or not 0 <= extra_delta < 1 or \
            not isinstance(unbounded, bool):
        raise LedgerDamaged(_damaged(path, f"charge {row_id}'s worst case is out of range"))
    return WorstCase(curve, extra_delta, unbounded)


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


# --- the file's defences: one writer, checksummed rows, the record outside the file --------


def _check_record(path: Path, contents: StoredLedger | None, record: LedgerRecord | None) -> None:
    """Refuse (``LedgerDamaged``) a file that is missing, emptied, replaced or shorter than its
    record says, or whose recorded entry is not the one recorded."""
    if record is None or record.entries == 0:
        return
    recorded = f"its record (kept outside the file) says it held {record.entries} entries"
    if contents is None:
        what = "it is missing" if not path.exists() else "it is empty"
        raise LedgerDamaged(_damaged(path, f"{what}, but {recorded}; a deleted or emptied ledger is not a fresh "
                                           "budget: restore the file"))
    if contents.ledger_id != record.ledger_id:
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


class _NotALedger(ConclaveError, ValueError):
    """A file that is not a privacy ledger (``why``: what it lacks); ``read_stored``'s ValueError."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path} is not a privacy ledger ({why})")
        self.why = why


def _damaged(path: Path, what: str) -> str:
    return f"ledger {path} is damaged: {what}; refusing to use it"


def _predates(path: Path) -> str:
    return (f"ledger {path} predates checksums: its charges cannot be verified, and a budget that cannot be "
            "verified is not a budget; refusing to use it")


def _short(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."
