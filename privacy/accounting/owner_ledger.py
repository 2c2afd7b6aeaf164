"""An owner's lifetime budget, and the ledger of everything ever released from its data.

The budget belongs to the data, not to a run: an owner declares (ε, δ) for its dataset once,
and every release computed from that dataset — teacher votes, DP-SGD schedules, DP-PCA, noisy
counts, smooth-sensitivity releases, in any run of any pipeline — is charged to the owner's
ledger before it is released. The ledger is a ``PrivacyLedger`` file on the owner's node whose
filter is the lifetime budget at one Rényi order, fixed when the file is created (the declared
``order``, or the one that suits the first run's planned work best). That is a Rényi filter
over the whole sequence of releases across runs, each chosen adaptively after the ones before
(Feldman & Zrnic, NeurIPS 2021, Thm 3.1), so the owner's lifetime (ε, δ) holds for every pair
of neighbouring datasets of that owner, whatever the runs did; a run that would pass it is
refused before anything is released. A lifetime budget cannot change once spent on: a budget
changed after the fact is no longer one declared in advance.

A ledger that is missing is not a fresh budget. Each ledger file carries a random identity
written at creation (``PrivacyLedger.ledger_id``); every owner's node keeps what it last saw of the other owners' ledgers
(identity and number of charges) in ``<owner>.peers.json`` beside its own ledger, and the
driver keeps the same record in the run's results folder. An owner whose ledger is missing,
replaced (another identity) or shorter than a record says is refused before the run starts.

The dataset is identified by the owner's name; a fingerprint of its files (an HMAC under a
key that never leaves the owner's node, so it reveals no record) goes with each charge in the
owner's own ledger, to show which version of the data paid. The fingerprint never leaves the
node: whether the data changed between runs is itself a fact about the records.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from conclave.privacy.accounting.charge import ADD_REMOVE, NEIGHBOURING, PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter, choose_order
from conclave.privacy.accounting.ledger import BudgetExceeded, BudgetReport, PrivacyLedger, read_ledger

log = logging.getLogger(__name__)

HOME_VARIABLE = "CONCLAVE_HOME"  # where Conclave keeps state on a machine (default ~/.conclave)


def conclave_home() -> Path:
    """This machine's Conclave folder: ``$CONCLAVE_HOME``, else ``~/.conclave``."""
    return Path(os.environ.get(HOME_VARIABLE) or "~/.conclave").expanduser()


class LedgerMissing(RuntimeError):
    """An owner's ledger is missing, replaced or shorter than a record of it says: refusing to
    start from a fresh budget."""


@dataclass(frozen=True)
class OwnerBudget:
    """What an owner allows to be released from its data over its lifetime: (``epsilon``,
    ``delta``)-DP for ``neighbouring`` datasets, enforced at the Rényi ``order`` (None: fixed
    when the ledger is created, from the first run's planned work). ``reserved_delta``: the
    part of δ that releases spending δ outside their RDP curve may use (the stability
    mechanism). ``directory``: where the ledger lives on the owner's node (None:
    ``$CONCLAVE_HOME/owners`` there, by default ``~/.conclave/owners``)."""

    epsilon: float
    delta: float = 1e-5
    neighbouring: str = ADD_REMOVE
    order: float | None = None
    reserved_delta: float = 0.0
    directory: str | None = None

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"budget.epsilon must be a finite number > 0, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise ValueError(f"budget.delta must be in (0, 1), got {self.delta}")
        if not 0 <= self.reserved_delta < self.delta:
            raise ValueError(f"budget.reserved_delta must be in [0, delta), got {self.reserved_delta}")
        if self.neighbouring not in NEIGHBOURING:
            raise ValueError(f"budget.neighbouring must be one of {sorted(NEIGHBOURING)}, got {self.neighbouring!r}")
        if self.order is not None:
            RenyiFilter(self.epsilon, self.delta, self.order, self.reserved_delta)  # a bad order: an error now

    def filter(self, planned: PrivacyCharge) -> RenyiFilter:
        """The lifetime filter a new ledger declares: at ``order``, or at the order where the
        budget admits the most of ``planned`` (public settings only, as for a run's budget)."""
        order = self.order
        if order is None:  # choose_order reserves the workload's extra δ: reserve the owner's instead
            order = choose_order(dataclasses.replace(planned, extra_delta=self.reserved_delta),
                                 self.epsilon, self.delta)
        return RenyiFilter(self.epsilon, self.delta, order, self.reserved_delta)

    def ledger_path(self, owner: str) -> Path:
        """The owner's ledger file, resolved on the machine that calls this (the owner's node)."""
        folder = Path(self.directory).expanduser() if self.directory else conclave_home() / "owners"
        return folder / f"{owner}.sqlite"


@dataclass(frozen=True)
class LedgerIdentity:
    """Which ledger file (``path`` on the owner's node, and the identity written in it) holds an
    owner's budget, and how many charges it held when seen."""

    owner: str
    path: str
    ledger_id: str
    charges: int


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


class OwnerLedger:
    """One owner's lifetime ledger, opened on the owner's node for one run (``run``)."""

    def __init__(self, owner: str, budget: OwnerBudget, data_paths: tuple[str, ...] = ()) -> None:
        self.owner, self.budget = owner, budget
        self.path = budget.ledger_path(owner)  # resolved here, on the owner's node
        self._data_paths = data_paths
        self._ledger: PrivacyLedger | None = None
        self._run = ""
        self._fingerprint = ""

    # --- before the run: identity and the records of other owners' ledgers --------------------

    def ledger_file(self) -> str:
        return str(self.path)

    def identity(self) -> LedgerIdentity | None:
        """This owner's ledger as it is on disk (None: no file), read without writing."""
        if self._ledger is not None:
            return LedgerIdentity(self.owner, str(self.path), self._ledger_id(), self._ledger.report().charges)
        if not self.path.exists():
            return None
        snapshot = read_ledger(self.path)
        return LedgerIdentity(self.owner, str(self.path), snapshot.ledger_id, snapshot.charges)

    def peer_records(self) -> list[LedgerIdentity]:
        """What this node last saw of the other owners' ledgers."""
        peers = self._peers_path()
        if not peers.exists():
            return []
        return [LedgerIdentity(**entry) for entry in json.loads(peers.read_text())]

    def note_peers(self, seen: list[LedgerIdentity]) -> None:
        """Keep what the run saw of every other owner's ledger (the newest record wins)."""
        records = {(r.owner, r.path): r for r in self.peer_records()}
        records.update({(r.owner, r.path): r for r in seen if r.owner != self.owner})
        target = self._peers_path()
        staged = target.with_suffix(".tmp")
        staged.write_text(json.dumps([dataclasses.asdict(r) for r in records.values()], indent=1))
        os.replace(staged, target)

    # --- the run ---------------------------------------------------------------------------

    def open(self, planned: PrivacyCharge, run: str) -> LedgerIdentity:
        """Open (or create, with the lifetime filter fixed from ``planned``) the ledger for
        ``run``. A file whose declared budget differs from the owner's is refused: a lifetime
        budget cannot change once spent on."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if planned.neighbouring != self.budget.neighbouring:
            raise ValueError(f"owner {self.owner}: its budget is for {self.budget.neighbouring} neighbours, the run's "
                             f"releases are bounded for {planned.neighbouring}")
        if self.path.exists():
            ledger = PrivacyLedger.open_existing(self.path)
            declared = ledger.budget
            if declared is None or (declared.epsilon, declared.delta, declared.reserved_delta) != (
                    self.budget.epsilon, self.budget.delta, self.budget.reserved_delta) or (
                    self.budget.order is not None and declared.order != self.budget.order):
                ledger.close()
                raise ValueError(f"owner {self.owner}: its ledger {self.path} holds the lifetime budget "
                                 f"{_budget_text(declared)}; the config declares ε {self.budget.epsilon:g} at "
                                 f"δ {self.budget.delta:g} (a lifetime budget cannot change once spent on)")
        else:
            ledger = PrivacyLedger(self.path, self.budget.delta, self.budget.filter(planned),
                                   neighbouring=self.budget.neighbouring)
        self._ledger, self._run = ledger, run
        self._fingerprint = self._fingerprint_data()
        return LedgerIdentity(self.owner, str(self.path), self._ledger_id(), ledger.report().charges)

    def refusal(self, charge: PrivacyCharge) -> str | None:
        """None when ``charge`` fits the lifetime budget now, else the refusal in one line."""
        return None if self._open().can_afford(charge) else self._refusal_line()

    def charge(self, charge: PrivacyCharge, worst_case: PrivacyCharge | None = None) -> str | None:
        """Record ``charge`` durably, tagged with the run and the data's fingerprint: None, or
        the refusal in one line (naming the owner and what its lifetime budget has left) when
        spent + ``worst_case`` would pass the budget — nothing is recorded then. A value, not
        an exception, because it crosses a process boundary."""
        tagged = dataclasses.replace(charge, details={**charge.details, "run": self._run,
                                                      "fingerprint": self._fingerprint})
        try:
            self._open().charge(tagged, worst_case=worst_case)
        except BudgetExceeded:
            return self._refusal_line()
        return None

    def _refusal_line(self) -> str:
        """One line: whose lifetime budget refuses, and what it has left."""
        report = self._open().report()
        left = report.remaining_rdp
        return (f"owner {self.owner}'s lifetime budget ε {report.epsilon_limit:g} at δ {report.delta:g} refuses it: "
                f"{left:.4g} of {report.budget.rdp_budget:.4g} left at Rényi order {report.budget.order:g} "
                f"(spent so far ε {report.epsilon_spent:.4g}, {report.charges} charges)")

    def report(self) -> BudgetReport:
        return self._open().report()

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    # --- internals -------------------------------------------------------------------------

    def _open(self) -> PrivacyLedger:
        if self._ledger is None:
            raise RuntimeError(f"owner {self.owner}: the ledger is not open")
        return self._ledger

    def _ledger_id(self) -> str:
        return self._open().ledger_id

    def _peers_path(self) -> Path:
        return self.path.with_name(f"{self.owner}.peers.json")

    def _fingerprint_data(self) -> str:
        """HMAC-SHA256 of the owner's files under a key kept beside the ledger (never sent)."""
        key_file = self.path.with_name(f"{self.owner}.key")
        if not key_file.exists():
            descriptor = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as out:
                out.write(secrets.token_bytes(32))
        digest = hmac.new(key_file.read_bytes(), digestmod=hashlib.sha256)
        for root in self._data_paths:
            base = Path(root).expanduser()
            files = sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else [base]
            for file in files:
                if file.exists():
                    digest.update(str(file.relative_to(base) if base.is_dir() else file.name).encode())
                    with file.open("rb") as data:
                        for block in iter(lambda: data.read(1 << 20), b""):
                            digest.update(block)
        return digest.hexdigest()[:16]


def _budget_text(budget: RenyiFilter | None) -> str:
    return "none" if budget is None else f"ε {budget.epsilon:g} at δ {budget.delta:g} (order {budget.order:g})"


class DriverRecords:
    """What this machine, as a driver, last saw of owners' ledgers
    (``$CONCLAVE_HOME/driver-records.json``): a record the owners cannot delete."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or conclave_home() / "driver-records.json"

    def load(self) -> list[LedgerIdentity]:
        if not self.path.exists():
            return []
        return [LedgerIdentity(**entry) for entry in json.loads(self.path.read_text())]

    def note(self, seen: list[LedgerIdentity]) -> None:
        records = {(r.owner, r.path): r for r in self.load()}
        records.update({(r.owner, r.path): r for r in seen})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staged = self.path.with_suffix(".tmp")
        staged.write_text(json.dumps([dataclasses.asdict(r) for r in records.values()], indent=1))
        os.replace(staged, self.path)
