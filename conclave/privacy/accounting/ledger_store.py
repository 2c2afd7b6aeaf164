"""A ledger's durable store: one SQLite file, one writer, every entry chained by checksums.

One row per charge, in WAL mode with ``synchronous=FULL``: a charge is fsynced before
``append_charge`` returns, and callers release only after it returns, so a crash never forgets a
release. The answers a charge pays for go in the same transaction. A store opened with
``keep_record`` also keeps its length and last checksum outside the file (``ledger_records``),
written before each commit and put in place after it, so a record that cannot be written refuses
the entry with nothing charged (``LedgerUnwritable``), and nothing after a commit fails the charge.
"""
from __future__ import annotations

import json
import logging
import secrets
import sqlite3
import time
from pathlib import Path
from typing import IO

import numpy as np

from conclave.errors import InvalidValue, RunRefused
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.ledger_check import (
    check_record, columns, read_or_none, table_exists, unreadable, verified,
)
from conclave.privacy.accounting.ledger_format import (
    BUDGET_CHANGE, GAUSSIAN_PLAN, SCHEMA, WORST_CASE, BudgetChange, Heads, LedgerDamaged, LedgerSettings, StoredLedger,
    WorstCase, chain_checksum, damaged, field_bytes, predates_checksums, settings_checksum,
)
from conclave.privacy.accounting.ledger_lock import hold_lock
from conclave.privacy.accounting.ledger_records import LedgerRecord, LedgerRecords, StagedRecord

log = logging.getLogger(__name__)

_INSERT_ENTRY = ("charges (id, label, rdp, extra_delta, unbounded, reason, details, neighbouring, created, checksum) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")


class LedgerUnwritable(RunRefused, OSError):
    """The record a ledger keeps outside its file (``ledger_records``) cannot be written (a full
    disk, a file where its folder should be): the entry was refused, nothing was charged."""


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
        self._file_lock: IO[str] | None = None if in_memory else hold_lock(self.path)
        records = None if in_memory else LedgerRecords()
        try:
            record = None if records is None else records.get(self.path)
            if record is not None and record.entries:  # before SQLite could make an empty file a new ledger
                check_record(self.path, read_or_none(self.path), record)
            # autocommit mode: transactions are opened explicitly (BEGIN IMMEDIATE for writes).
            self._db = sqlite3.connect(str(self.path), timeout=60.0, isolation_level=None, check_same_thread=False)
            if table_exists(self._db, "charges") and "checksum" not in columns(self._db, "charges"):
                raise LedgerDamaged(predates_checksums(self.path))  # before anything below could write to it
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # fsync the WAL on every commit
            with self._transaction():
                contents = _create_or_check(self._connection(), self.path, settings)
            check_record(self.path, contents, record)
        except BaseException as error:
            self.close()
            found = unreadable(self.path, error)
            if found is not None:
                raise found from None
            raise
        self.opened = contents
        self.ledger_id = contents.ledger_id  # random, fixed at creation: tells this file from a new one
        self.entries = contents.entries
        self._heads = contents.heads
        self._record = _ChainRecord(self.path, self.ledger_id, records, keep_record or record is not None)
        try:
            self._record.note(self.entries, self._heads.charge)
        except OSError as error:
            self.close()
            raise self._record.unwritable(error) from error

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
            checksum = chain_checksum("answer batch", self._heads.batch, row, paid)
            _insert(self._connection(), self.path, "answer_batches (id, created, checksum) VALUES (?, ?, ?)",
                    (*row, checksum), batch_id)
            self._connection().executemany("INSERT INTO answers (key, answer, batch_id) VALUES (?, ?, ?)",
                                           [(key, answer, batch_id) for key, answer in paid])
            self._heads = Heads(self._heads.charge, checksum, batch_id)

    def answers(self) -> dict[bytes, int]:
        """Every answer on record (key → released value), read now and checked against the chain."""
        with self._transaction(write=False):
            contents = verified(self.path, self._connection())
        if contents is None:  # emptied behind the writer's back
            raise LedgerDamaged(damaged(self.path, "its settings (meta) are missing"))
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
            if self._record.behind:  # the last entry's record was not placed: in place first, or no entry
                self._record.note(self.entries, self._heads.charge)
            with self._transaction():
                paid = self._not_on_record(answers)
                checksum = chain_checksum("charge", self._heads.charge, row, paid)
                _insert(self._connection(), self.path, _INSERT_ENTRY, (*row, checksum), row_id)
                self._connection().executemany(
                    "INSERT INTO answers (key, answer, charge_id) VALUES (?, ?, ?)",
                    [(key, answer, row_id) for key, answer in paid])
                staged = self._record.stage(row_id, checksum)
        except BaseException as error:
            if staged is not None:  # staged, then the commit failed
                staged.discard()
            if isinstance(error, OSError):
                raise self._record.unwritable(error) from error
            raise
        self.entries += 1  # committed: the chain moves on, and so does its record outside the file
        self._heads = Heads(checksum, self._heads.batch, self._heads.batches)
        if staged is not None:
            self._record.placed(staged, self.entries)

    def _transaction(self, write: bool = True) -> _Transaction:
        return _Transaction(self._connection(), write)

    def _not_on_record(self, answers: dict[bytes, int]) -> list[tuple[bytes, int]]:
        """The answers whose keys are not on record yet (an answer, once released, stays), in
        the order their checksum covers them."""
        db = self._connection()
        fresh = [(key, int(answer)) for key, answer in answers.items()
                 if db.execute("SELECT 1 FROM answers WHERE key = ?", (key,)).fetchone() is None]
        return sorted(fresh, key=lambda item: field_bytes(item[0]))


class _ChainRecord:
    """The chain's length and last checksum, kept outside the file (``ledger_records``) in step
    with its commits: staged before a commit, put in place after it (``keep``: a record is kept;
    ``records``: None for an in-memory ledger). ``behind``: a committed entry's record could not
    be put in place."""

    def __init__(self, path: Path, ledger_id: str, records: LedgerRecords | None, keep: bool) -> None:
        self.path, self.ledger_id = path, ledger_id
        self._records, self._keep = records, keep
        self.behind = False

    def stage(self, entries: int, head: str) -> StagedRecord | None:
        """The record of the chain at ``entries`` rows ending in ``head``, staged (None: none kept)."""
        if not (self._keep and self._records is not None):
            return None
        return self._records.stage(LedgerRecord(str(self.path), self.ledger_id, entries, head))

    def note(self, entries: int, head: str) -> None:
        """Keep the chain's length and last checksum outside the file now (after a commit, so a
        record is never ahead of the file it describes)."""
        staged = self.stage(entries, head)
        if staged is not None:
            staged.place()
            self.behind = False

    def placed(self, staged: StagedRecord, entries: int) -> None:
        """Put ``staged`` in place once entry ``entries`` is committed. Placing the record is a
        rename in a folder just written; should it fail all the same, the entry stands (it is
        committed) and the record stays one entry behind — which accepts the file, never refuses
        it — until the next entry puts it in place first, or is refused."""
        try:
            staged.place()
        except OSError as error:
            self.behind = True
            log.error("ledger %s: entry %d is committed, but its record %s could not be put in place (%s); the "
                      "next entry puts it in place first, or is refused", self.path, entries, staged.target, error)
            return
        self.behind = False

    def unwritable(self, error: OSError) -> LedgerUnwritable:
        folder = self._records.folder if self._records is not None else self.path.parent
        return LedgerUnwritable(f"ledger {self.path}: its record in {folder} cannot be written "
                                f"({error.strerror or error}); nothing was charged")


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


def _create_or_check(db: sqlite3.Connection, path: Path, settings: LedgerSettings) -> StoredLedger:
    """Set up a new file with ``settings``, or check an existing one: its chain, then its
    settings (a file written with other settings is refused)."""
    if not table_exists(db, "charges"):
        for statement in SCHEMA:
            db.execute(statement)
    contents = verified(path, db)
    declared = settings.meta()
    if contents is None:  # a new file: declare the budget, once
        meta = {**declared, "ledger_id": secrets.token_hex(16)}
        meta["checksum"] = settings_checksum(meta)
        db.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", meta.items())
        return StoredLedger(meta, [], {}, Heads(meta["checksum"], meta["checksum"], 0))
    for key, value in declared.items():
        if contents.meta[key] != value:
            raise InvalidValue(
                f"ledger {path} was created with {key} = {_short(contents.meta[key])}, not "
                f"{_short(value)}: a budget is declared once, before the run; open the file with the settings "
                "it was created with, or start a new ledger file"
            )
    return contents


def _insert(db: sqlite3.Connection, path: Path, into: str, values: tuple, row_id: int) -> None:
    try:
        db.execute("INSERT INTO " + into, values)
    except sqlite3.IntegrityError:  # only a row this writer did not write can hold the next id
        raise LedgerDamaged(damaged(path, f"row {row_id} of {into.split()[0]} was written by something "
                                          "other than this ledger while it was open")) from None


def _short(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."
