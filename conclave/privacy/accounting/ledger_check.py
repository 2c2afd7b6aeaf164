"""Reading a ledger file and checking it: what its writer checks when it opens it, and what
readers read without writing or locking it.

Every row is checked against its chain (``ledger_format``) and SQLite's ``sqlite_sequence``, which
remembers the last id issued: an edited, deleted or truncated row, edited settings or a file older
than the checksums is refused (``LedgerDamaged``); a file with a record kept outside it
(``ledger_records``) that is missing, emptied, replaced or shorter than the record, too.
"""
from __future__ import annotations

import json
import math
import sqlite3
from collections import defaultdict
from pathlib import Path

import numpy as np

from conclave.errors import ConclaveError
from conclave.privacy.accounting.ledger_format import (
    BUDGET_CHANGE, GAUSSIAN_PLAN, TABLES, WORST_CASE, BudgetChange, Heads, LedgerDamaged, LedgerSettings, StoredCharge,
    StoredEntry, StoredLedger, WorstCase, chain_checksum, damaged, field_bytes, predates_checksums, settings_checksum,
)
from conclave.privacy.accounting.ledger_records import LedgerRecord, LedgerRecords
from conclave.privacy.accounting.pld import GaussianSteps

def read_stored(path: Path) -> StoredLedger:
    """A ledger file's checked contents, read in one transaction without writing or locking;
    for a file with a record, checked against it first: a missing or emptied file is then
    refused as such, not read as no ledger. FileNotFoundError without a file, ValueError for a
    file that is not a ledger."""
    record = LedgerRecords().get(path)
    if record is None or not record.entries:
        return _read(path)
    contents = read_or_none(path)
    check_record(path, contents, record)
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
            contents = verified(path, db)
            db.execute("COMMIT")
        finally:
            db.close()
    except sqlite3.DatabaseError as error:
        found = unreadable(path, error)
        if found is not None:
            raise found from None
        raise _NotALedger(path, str(error)) from None
    if contents is None:
        raise _NotALedger(path, "it declares no settings")
    return contents


def read_or_none(path: Path) -> StoredLedger | None:
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
        raise LedgerDamaged(damaged(path, f"it does not read as a privacy ledger ({error.why}), yet a record of "
                                          "it is kept outside the file: restore the file")) from None


def verified(path: Path, db: sqlite3.Connection) -> StoredLedger | None:
    """Everything in the ledger, each row checked against its chain; None for a file with the
    tables but nothing in them yet. Raises LedgerDamaged naming the first thing not as written."""
    if not table_exists(db, "charges"):
        raise _NotALedger(path, "it has no charges table")
    if "checksum" not in columns(db, "charges"):
        raise LedgerDamaged(predates_checksums(path))
    for table in TABLES:
        if not table_exists(db, table):
            raise LedgerDamaged(damaged(path, f"its {table} table is missing"))
    meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
    # AUTOINCREMENT keeps the last id each table issued: a deleted last row still shows.
    issued = dict(db.execute("SELECT name, seq FROM sqlite_sequence").fetchall())
    if not meta:
        if issued or any(db.execute(f"SELECT EXISTS (SELECT 1 FROM {table})").fetchone()[0] for table in TABLES):
            raise LedgerDamaged(damaged(path, "its settings (meta) are missing"))
        return None
    if meta.get("checksum") != settings_checksum(meta):
        raise LedgerDamaged(damaged(path, "its settings (meta) do not match their checksum (edited)"))
    if not isinstance(meta.get("ledger_id"), str):
        raise LedgerDamaged(damaged(path, "its settings (meta) hold no ledger id"))
    size = LedgerSettings.stored(path, meta).orders.size

    by_charge: dict[int, list[tuple[bytes, int]]] = defaultdict(list)
    by_batch: dict[int, list[tuple[bytes, int]]] = defaultdict(list)
    answers: dict[bytes, int] = {}
    for key, answer, charge_id, batch_id in db.execute("SELECT key, answer, charge_id, batch_id FROM answers"):
        if (charge_id is None) == (batch_id is None):
            raise LedgerDamaged(damaged(path, "an answer belongs to no charge, or to two (edited)"))
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
            raise LedgerDamaged(damaged(path, f"charge {row_id}'s RDP curve is not {size} non-negative numbers"))
        if not (isinstance(extra_delta, float) and 0 <= extra_delta < 1) or unbounded not in (0, 1):
            raise LedgerDamaged(damaged(path, f"charge {row_id}'s extra delta or unbounded flag is out of range"))
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
    return StoredLedger(meta, charges, answers, Heads(head, batch_head, batches), len(checksums), tuple(checksums),
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
        raise LedgerDamaged(damaged(path, f"charge {row_id}'s worst case does not parse ({err})")) from None
    if curve.shape != (size,) or np.any(np.isnan(curve)) or np.any(curve < 0) or not 0 <= extra_delta < 1 or \
            not isinstance(unbounded, bool):
        raise LedgerDamaged(damaged(path, f"charge {row_id}'s worst case is out of range"))
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
        raise LedgerDamaged(damaged(path, f"entry {row_id} is a budget change that does not parse"))
    return change


def check_record(path: Path, contents: StoredLedger | None, record: LedgerRecord | None) -> None:
    """Refuse (``LedgerDamaged``) a file that is missing, emptied, replaced or shorter than its
    record says, or whose recorded entry is not the one recorded."""
    if record is None or record.entries == 0:
        return
    recorded = f"its record (kept outside the file) says it held {record.entries} entries"
    if contents is None:
        what = "it is missing" if not path.exists() else "it is empty"
        raise LedgerDamaged(damaged(path, f"{what}, but {recorded}; a deleted or emptied ledger is not a fresh "
                                          "budget: restore the file"))
    if contents.ledger_id != record.ledger_id:
        raise LedgerDamaged(damaged(path, f"it is another file than the one recorded, and {recorded}; a new ledger "
                                          "is not a fresh budget: restore the original"))
    if contents.entries < record.entries:
        raise LedgerDamaged(damaged(path, f"it holds {contents.entries} entries but {recorded}; a shortened ledger "
                                          "is not a fresh budget: restore the full file"))
    if contents.checksums[record.entries - 1] != record.head:
        raise LedgerDamaged(damaged(path, f"its entry {record.entries} is not the one its record saw (rewritten)"))


def _check_link(path: Path, kind: str, expected: int, row: tuple, previous: str,
                answers: list[tuple[bytes, int]]) -> None:
    """Row ``expected`` of a chain: there, and its checksum over ``previous``, its fields and its answers."""
    if row[0] != expected:
        raise LedgerDamaged(damaged(path, f"{kind} {expected} is missing (deleted)"))
    answers.sort(key=lambda item: field_bytes(item[0]))
    if row[-1] != chain_checksum(kind, previous, row[:-1], answers):
        raise LedgerDamaged(damaged(path, f"{kind} {expected}'s checksum does not match (edited or truncated)"))


def _check_end(path: Path, kind: str, count: int, issued: int, orphans: dict[int, list]) -> None:
    """A chain's end: as many rows as ids were issued, and no answers pointing past them."""
    if issued > count:
        raise LedgerDamaged(damaged(path, f"{kind} {count + 1} is missing (deleted or truncated)"))
    if issued != count:
        raise LedgerDamaged(damaged(path, f"it holds {count} {kind} rows but issued {issued} ids (edited)"))
    if orphans:
        raise LedgerDamaged(damaged(path, f"answers point at {kind} {min(orphans)}, which is not in the ledger"))


def table_exists(db: sqlite3.Connection, table: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone() is not None


def columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def unreadable(path: Path, error: BaseException) -> LedgerDamaged | None:
    """SQLite's own finding that the file is damaged, as one line; None for anything else
    (e.g. a busy or missing file)."""
    code = (getattr(error, "sqlite_errorcode", None) or 0) & 0xFF
    if code == sqlite3.SQLITE_CORRUPT:
        return LedgerDamaged(damaged(path, f"SQLite cannot read it ({error})"))
    if code == sqlite3.SQLITE_NOTADB:  # a header overwritten, or another kind of file
        return LedgerDamaged(f"ledger {path} is damaged or is not a privacy ledger: SQLite cannot read it "
                             f"({error}); refusing to use it")
    return None


class _NotALedger(ConclaveError, ValueError):
    """A file that is not a privacy ledger (``why``: what it lacks); ``read_stored``'s ValueError."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path} is not a privacy ledger ({why})")
        self.why = why


