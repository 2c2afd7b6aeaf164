"""A ledger's length and last checksum, kept outside its file: a shorter ledger is refused.

A ledger's checksum chain (``privacy.accounting.ledger_format``) reveals an edited or damaged row, but a
shorter chain is still a valid chain: deleting the file, truncating it to 0 bytes, or deleting its
last rows and resetting SQLite's sequence leaves a ledger that checks out with less spent — a
budget reset. So a ledger that must outlive its process (a service's, a run folder's durable one,
an owner's lifetime ledger) keeps a record beside nothing it could be deleted with: a small file
in this machine's Conclave folder (``$CONCLAVE_HOME/ledgers/``), rewritten with every commit,
naming the file, its identity, how many rows its chain holds and the checksum of the last one.
A file that is missing, empty, shorter than its record, another file (another identity), or whose
row N is not the row the record saw is refused (``LedgerDamaged``), before anything is charged.

What it does not defend: someone who rewrites both the file and its record, or deletes both.
The checksums have no key, so whoever can write this machine's Conclave folder and the ledger
can forge a consistent pair.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from conclave.errors import InvalidValue

HOME_VARIABLE = "CONCLAVE_HOME"  # where Conclave keeps state on a machine (default ~/.conclave)


def conclave_home() -> Path:
    """This machine's Conclave folder: ``$CONCLAVE_HOME``, else ``~/.conclave``."""
    return Path(os.environ.get(HOME_VARIABLE) or "~/.conclave").expanduser()


@dataclass(frozen=True)
class LedgerRecord:
    """What a ledger file held when last committed: its identity, the number of rows of its
    charge chain (charges and budget changes) and the checksum of the last (the settings'
    checksum for none)."""

    path: str
    ledger_id: str
    entries: int
    head: str


class LedgerRecords:
    """The records of this machine's kept ledgers, one small JSON file each, named by a hash of
    the ledger's resolved path (``folder``: default ``$CONCLAVE_HOME/ledgers``)."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder if folder is not None else conclave_home() / "ledgers"

    def get(self, ledger: Path) -> LedgerRecord | None:
        """The record of ``ledger`` (None: none kept). A record that cannot be read is an error,
        not an absent record: it is written whole or not at all (``note``)."""
        target = self._file(ledger)
        if not target.exists():
            return None
        try:
            record = LedgerRecord(**json.loads(target.read_text()))
        except (OSError, TypeError, ValueError) as err:
            raise InvalidValue(f"the record of ledger {ledger} ({target}) cannot be read ({type(err).__name__}); "
                             "refusing to use the ledger without it") from None
        return record

    def note(self, record: LedgerRecord) -> None:
        """Keep ``record``, whole or not at all (``stage``, then ``StagedRecord.place``)."""
        self.stage(record).place()

    def stage(self, record: LedgerRecord) -> StagedRecord:
        """Write ``record`` beside its place, not in it yet: a ledger stages the record of an entry
        before committing the entry, so that a folder that cannot be written refuses the entry
        before anything is charged, and places it after the commit (a rename, which needs no
        room), so that a record is never ahead of its file. Not fsynced — it would double the
        cost of a charge, whose ledger commit is fsynced already: after a machine crash the
        record may be older than the file, which only ever accepts a file, never refuses one
        wrongly."""
        self.folder.mkdir(parents=True, exist_ok=True)
        target = self._file(Path(record.path))
        staged = StagedRecord(target.with_suffix(f".{os.getpid()}.tmp"), target)
        try:
            staged.staged.write_text(json.dumps(dataclasses.asdict(record)))
        except OSError:  # e.g. a full disk, part way
            staged.discard()
            raise
        return staged

    def _file(self, ledger: Path) -> Path:
        digest = hashlib.sha256(str(resolved(ledger)).encode()).hexdigest()[:32]
        return self.folder / f"{digest}.json"


@dataclass(frozen=True)
class StagedRecord:
    """A record written beside its place (``LedgerRecords.stage``): placed, or discarded."""

    staged: Path
    target: Path

    def place(self) -> None:
        try:
            os.replace(self.staged, self.target)
        except OSError:
            self.discard()
            raise

    def discard(self) -> None:
        """Remove the staged file, if it can be (one left behind is rewritten by the next ``stage``)."""
        with contextlib.suppress(OSError):
            self.staged.unlink(missing_ok=True)


def resolved(ledger: Path) -> Path:
    """The path a record is kept under: absolute, with symbolic links of its folder resolved."""
    ledger = Path(ledger).expanduser()
    return ledger.parent.resolve() / ledger.name
