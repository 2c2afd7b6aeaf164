"""Which ledger file holds an owner's budget, and the records others keep of it.

A missing ledger is not a fresh budget. Each ledger file carries a random identity written at
creation (``PrivacyLedger.ledger_id``); every owner's node keeps what it last saw of the other
owners' ledgers (identity and number of entries) in ``<owner>.peers.json`` beside its own ledger,
and the driver keeps the same record (``DriverRecords``). An owner whose ledger is missing,
replaced or shorter than a record says is refused before the run starts (``check_not_missing``).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from conclave.privacy.accounting.ledger import read_ledger
from conclave.privacy.accounting.ledger_records import conclave_home
from conclave.privacy.accounting.owner_policy import OwnerRefused


class LedgerMissing(OwnerRefused):
    """An owner's ledger is missing, replaced or shorter than a record of it says: refusing to
    start from a fresh budget."""


@dataclass(frozen=True)
class LedgerIdentity:
    """Which ledger file (``path`` on the owner's node, and the identity written in it) holds an
    owner's budget, and how many entries it held when seen."""

    owner: str
    path: str
    ledger_id: str
    charges: int  # entries of its chain (charges and budget changes)

    @classmethod
    def on_disk(cls, owner: str, path: Path) -> LedgerIdentity | None:
        """``owner``'s ledger at ``path`` as it is on disk (None: no file), read without writing."""
        if not path.exists():
            return None
        snapshot = read_ledger(path)
        return cls(owner, str(path), snapshot.ledger_id, snapshot.entries)


def check_not_missing(owner: str, expected_path: str, found: LedgerIdentity | None,
                      records: list[tuple[str, LedgerIdentity]]) -> None:
    """Refuse (``LedgerMissing``, one line) when ``owner``'s ledger at ``expected_path``, as
    ``found`` on its node (None: no file), is missing, replaced or shorter than any of
    ``records`` — (who keeps the record, what it saw) — says."""
    for keeper, seen in records:
        if (seen.owner, seen.path) != (owner, expected_path) or seen.charges == 0:
            continue
        if found is None:
            raise LedgerMissing(f"owner {owner}: its ledger is missing, but {keeper} has a record of {seen.charges} "
                                f"charges in it; restore the file (a deleted ledger is not a fresh budget)")
        if found.ledger_id != seen.ledger_id:
            raise LedgerMissing(f"owner {owner}: its ledger was replaced (another file than the one {keeper} "
                                f"records, with {seen.charges} charges); restore the original")
        if found.charges < seen.charges:
            raise LedgerMissing(f"owner {owner}: its ledger holds {found.charges} charges but {keeper} has a record "
                                f"of {seen.charges}; restore the full file")


class IdentityRecords:
    """What one keeper last saw of owners' ledgers, in a JSON file at ``path`` (the newest record
    of each ledger wins); ``others_than``: an owner whose own ledger it does not record."""

    def __init__(self, path: Path, others_than: str | None = None) -> None:
        self.path, self.others_than = path, others_than

    @classmethod
    def of_peers(cls, owner: str, ledger_path: Path) -> IdentityRecords:
        """What ``owner``'s node, whose ledger is at ``ledger_path``, saw of the other owners' ledgers."""
        return cls(ledger_path.with_name(f"{owner}.peers.json"), others_than=owner)

    def load(self) -> list[LedgerIdentity]:
        if not self.path.exists():
            return []
        return [LedgerIdentity(**entry) for entry in json.loads(self.path.read_text())]

    def note(self, seen: list[LedgerIdentity]) -> None:
        records = {(r.owner, r.path): r for r in self.load()}
        records.update({(r.owner, r.path): r for r in seen if r.owner != self.others_than})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staged = self.path.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(json.dumps([dataclasses.asdict(r) for r in records.values()], indent=1))
        os.replace(staged, self.path)


class DriverRecords(IdentityRecords):
    """What this machine, as a driver, last saw of owners' ledgers
    (``$CONCLAVE_HOME/driver-records.json``): a record the owners cannot delete."""

    def __init__(self, path: Path | None = None) -> None:
        super().__init__(path or conclave_home() / "driver-records.json")
