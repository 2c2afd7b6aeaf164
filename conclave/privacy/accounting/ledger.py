"""The ledger: what every release is charged to before it leaves.

``ChargeGate`` is what a release is checked against and charged to: any ``Ledger``, or several
as one (NearPrivate's run and model ledgers, ``cluster.active_learning.BothLedgers``). ``Ledger``
is the one protocol of a run's or a service's ledger (``PrivacyLedger``) and an owner's lifetime
ledger (``owner_ledger.OwnerLedger``, kept by its gateway): ask (``refusal``), charge (``charge``:
recorded durably before anything is released, or refused with ``BudgetExceeded``, recording
nothing), read (``report``, ``spent``).
``AnsweringLedger`` adds the answers a labelling service repeats, free. As in dp_accounting's
``PrivacyAccountant`` and Opacus's ``IAccountant``, the math is kept apart from the state.

A ``PrivacyLedger`` is three parts behind the protocol: the math (``ledger_totals``: what the charges
compose to, and ``filter.RenyiFilter``: refuse what would pass the budget at one fixed Rényi order),
the durable store (``ledger_store``: one SQLite file, one writer, a checksum chain, its length kept
outside the file) and the answer record (``AnswerRecord``: the answers a charge pays for, written in
the same transaction as the charge).
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from conclave.errors import ConclaveError, InvalidValue, first_line
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter, order_index
from conclave.privacy.accounting.guarantee import Guarantee, filter_guarantee
from conclave.privacy.accounting.ledger_check import read_entries, read_stored
from conclave.privacy.accounting.ledger_format import (
    BUDGET_CHANGE, BudgetChange, LedgerDamaged, LedgerSettings, StoredCharge, WorstCase,
)
from conclave.privacy.accounting.ledger_lock import LedgerInUse
from conclave.privacy.accounting.ledger_store import LedgerStore, LedgerUnwritable
from conclave.privacy.accounting.ledger_totals import BudgetReport, LedgerTotals, current_budget, largest_budget
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS

# The store's entry label and errors, and the report, belong to the ledger's contract: callers find them here.
__all__ = [
    "BUDGET_CHANGE", "AnswerRecord", "AnsweringLedger", "BudgetChange", "BudgetExceeded", "BudgetReport", "ChargeGate",
    "ChargeRecord", "Ledger", "LedgerDamaged", "LedgerInUse", "LedgerSnapshot", "LedgerUnwritable", "PrivacyLedger",
    "current_budget", "largest_budget", "read_history", "read_ledger",
]


class BudgetExceeded(ConclaveError):
    """A charge was refused: it would pass the run's privacy budget. Nothing was recorded."""

    exit_code = 4

    def run_line(self, run: str) -> str:
        line = first_line(self)
        where = ("" if line.startswith("owner ") else
                 " (the ledger in its results folder keeps what earlier runs on the same data spent)")
        return f"run '{run}' refused by a privacy ledger: {line}{where}"


@runtime_checkable
class ChargeGate(Protocol):
    """What a release is checked against (``can_afford``, recording nothing) and charged to
    (``charge``: recorded before the release, or ``BudgetExceeded``, recording nothing)."""

    def can_afford(self, charge: PrivacyCharge) -> bool: ...

    def charge(self, charge: PrivacyCharge) -> object: ...


@runtime_checkable
class Ledger(ChargeGate, Protocol):
    """What a release is charged to before it leaves (module docstring): the run's, a service's,
    an owner's, or the run's with its owners' behind it. Its settings are fixed when it is
    opened; ``last_refusal`` is the latest refusal's line (why a run stopped)."""

    last_refusal: str | None

    @property
    def path(self) -> Path: ...

    @property
    def delta(self) -> float: ...

    @property
    def neighbouring(self) -> Neighbouring: ...

    @property
    def orders(self) -> np.ndarray: ...

    @property
    def budget(self) -> RenyiFilter | None: ...  # None: it records only and refuses nothing

    def refusal(self, charge: PrivacyCharge) -> str | None:
        """Why ``charge`` would be refused now, in one line, or None; records nothing."""
        ...

    def can_afford(self, charge: PrivacyCharge) -> bool:
        """Whether ``charge`` would be accepted now; records nothing."""
        ...

    def charge(self, charge: PrivacyCharge, worst_case: PrivacyCharge | None = None) -> BudgetReport:
        """Record ``charge`` durably and return the new report, or raise ``BudgetExceeded``
        (recording nothing) when spent + ``worst_case`` (default: the charge) would pass the
        budget. Call before releasing anything the charge pays for."""
        ...

    def report(self) -> BudgetReport:
        ...

    def spent(self) -> PrivacyCharge:
        """Everything recorded so far as one composed charge."""
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class AnsweringLedger(Ledger, Protocol):
    """A ledger that keeps the answers its charges paid for (the run's and ``serve``'s, not an
    owner's): written with the charge, in the same transaction, so a restarted service repeats
    them free and identical."""

    def charge(self, charge: PrivacyCharge, worst_case: PrivacyCharge | None = None,
               answers: dict[bytes, int] | None = None) -> BudgetReport:
        """``Ledger.charge``, writing ``answers`` (key → released value) with it."""
        ...

    answers: AnswerRecord  # every answer on record, and those an earlier charge already paid for

    def worst_case_spent(self) -> PrivacyCharge:
        """Every charge recorded so far at the worst case it was checked against, composed."""
        ...


class AnswerRecord:
    """The answers a ledger's charges paid for (key → released value), in its file, so that a
    restarted service repeats them free and identical. Those a charge pays for are written with it
    (``PrivacyLedger.charge``); ``record`` adds those an earlier charge already paid for."""

    def __init__(self, store: LedgerStore, lock: threading.Lock) -> None:
        self._store, self._lock = store, lock

    def record(self, answers: dict[bytes, int]) -> None:
        """Record answers whose cost an earlier charge already paid (e.g. inside an open
        stability run), so that a restart repeats them too."""
        with self._lock:
            self._store.add_answers(answers)

    def read(self) -> dict[bytes, int]:
        """Every answer on record (key → released value), checked against the chain."""
        with self._lock:
            return self._store.answers()


class PrivacyLedger:
    """Composes every charge of a run, durably, refusing what its budget does not admit.

    ``budget=None`` makes a record-only ledger: it refuses nothing, also not unbounded charges
    (its report then has ``bounded = False``), and a run's guarantee comes from its planned worst
    case (``privacy.accounting.guarantee``). ``delta`` is the run's δ; with a budget it must equal
    the budget's. The budget, δ, the orders and the neighbouring relation are written into the
    file when it is created, and reopening it with others is refused: a budget changed mid-run is
    no longer declared in advance (only its owner changes it, ``change_budget``). A charge for
    another neighbouring relation is an error, not a refusal: bounds for different relations do
    not compose as one.

    ``path`` ``":memory:"`` keeps nothing on disk. ``keep_record``: keep the file's length and
    last checksum outside it, for a ledger that must outlive its process. Raises ``LedgerInUse``
    while another writer holds the file and ``LedgerDamaged`` when its contents fail their
    checksums or are shorter than its record. Thread-safe: check-and-commit is atomic.
    """

    def __init__(self, path: str | Path, delta: float, budget: RenyiFilter | None = None,
                 neighbouring: Neighbouring = Neighbouring.ADD_REMOVE, orders=DEFAULT_ORDERS,
                 keep_record: bool = False) -> None:
        if not 0 < delta < 1:
            raise InvalidValue(f"delta must be in (0, 1), got {delta}")
        if budget is not None and budget.delta != delta:
            raise InvalidValue(f"the budget's delta {budget.delta:g} differs from the ledger's {delta:g}")
        self.path = Path(path)
        self.delta = float(delta)
        self.neighbouring = Neighbouring.of(neighbouring)
        self.orders = np.asarray(orders, dtype=float)
        if self.orders.ndim != 1 or self.orders.size == 0 or np.any(self.orders <= 1):
            raise InvalidValue("orders must be a non-empty 1-D list of numbers > 1")
        self._budget_index = None if budget is None else order_index(budget.order, self.orders)
        self._lock = threading.Lock()
        self.last_refusal: str | None = None  # the latest refusal's line (why a run stopped)
        self._store = LedgerStore(path, LedgerSettings(self.delta, budget, neighbouring, self.orders), keep_record)
        self._totals = LedgerTotals(self.orders, self.delta, self.neighbouring)
        for stored in self._store.opened.charges:
            self._totals.add(stored)
        self.answers = AnswerRecord(self._store, self._lock)
        self.ledger_id = self._store.ledger_id  # random, fixed at creation: tells this file from a new one
        self.changes: tuple[BudgetChange, ...] = self._store.opened.changes
        self.budget = current_budget(budget, self.changes)

    @classmethod
    def open_existing(cls, path: str | Path, keep_record: bool = False) -> PrivacyLedger:
        """Reopen a ledger file with the settings it was created with (to read or keep charging it)."""
        path = Path(path)
        declared = LedgerSettings.stored(path, read_stored(path).meta)
        return cls(path, declared.delta, declared.budget, neighbouring=declared.neighbouring, orders=declared.orders,
                   keep_record=keep_record)

    # --- public API -----------------------------------------------------------------------

    def charge(self, charge: PrivacyCharge, worst_case: PrivacyCharge | None = None,
               answers: dict[bytes, int] | None = None) -> BudgetReport:
        """Record ``charge`` (and the ``answers`` it pays for) durably and return the new
        report — or raise BudgetExceeded (recording nothing) when spent + ``worst_case``
        (default: the charge) would pass the budget. Call before releasing anything the
        charge pays for."""
        _check_fits(charge, self.orders, self.neighbouring)
        if charge.label == BUDGET_CHANGE:
            raise InvalidValue(f"{BUDGET_CHANGE!r} labels the budget's changes, not a charge")
        if worst_case is not None:
            _check_fits(worst_case, self.orders, self.neighbouring)
            if np.any(charge.rdp > worst_case.rdp * (1 + 1e-9) + 1e-15) or charge.extra_delta > worst_case.extra_delta * (
                1 + 1e-9
            ) or (charge.unbounded and not worst_case.unbounded):
                raise InvalidValue(f"charge {charge.label!r} exceeds the worst case it was checked against")
        with self._lock:
            self._store.check_open()
            refused = self._totals.refusal(self.budget, self._budget_index,
                                           worst_case if worst_case is not None else charge)
            if refused is not None:
                self.last_refusal = refused
                raise BudgetExceeded(refused)
            worst = WorstCase.beyond(charge, worst_case)
            self._store.append_charge(charge, answers or {}, worst)
            # Only after COMMIT succeeded does the new row enter the running totals.
            self._totals.add(StoredCharge(charge.label, np.asarray(charge.rdp, dtype="<f8"), float(charge.extra_delta),
                                          bool(charge.unbounded), charge.pld, worst))
            return self._totals.report(self.budget, self._budget_index, self.changes)

    def change_budget(self, epsilon: float) -> BudgetChange:
        """Change the budget's ε from now on (δ, order and reserved δ stay), as an entry of the
        chain: only the data's owner does this (``conclave owner raise`` / ``lower``). The
        filter refuses past the new limit; the guarantee stays the largest budget declared."""
        if self.budget is None:
            raise InvalidValue(f"ledger {self.path} records only: it has no budget to change")
        new = dataclasses.replace(self.budget, epsilon=float(epsilon))  # a limit with no RDP budget: ValueError
        with self._lock:
            self._store.check_open()
            change = self._store.append_budget_change(self.budget.epsilon, new.epsilon)
            self.budget, self.changes = new, (*self.changes, change)
            return change

    def can_afford(self, charge: PrivacyCharge) -> bool:
        """Whether ``charge`` would be accepted now (nothing is recorded)."""
        return self.refusal(charge) is None

    def refusal(self, charge: PrivacyCharge) -> str | None:
        """Why ``charge`` would be refused now, in one line, or None (nothing is recorded)."""
        _check_fits(charge, self.orders, self.neighbouring)
        with self._lock:
            self._store.check_open()
            refused = self._totals.refusal(self.budget, self._budget_index, charge)
            if refused is not None:
                self.last_refusal = refused
            return refused

    def report(self) -> BudgetReport:
        with self._lock:
            self._store.check_open()
            return self._totals.report(self.budget, self._budget_index, self.changes)

    def spent(self) -> PrivacyCharge:
        """Everything recorded so far as one composed charge (curve, Σ extra δ, unbounded)."""
        with self._lock:
            self._store.check_open()
            return self._totals.spent()

    def worst_case_spent(self) -> PrivacyCharge:
        """Every charge recorded so far at the worst case it was checked against (its own where
        none was given), composed: what the run's guarantee composes where its plan no longer
        covers what it charged (``guarantee.run_worst_case``)."""
        with self._lock:
            self._store.check_open()
            return self._totals.worst_case()

    def close(self) -> None:
        with self._lock:
            self._store.close()

    def __enter__(self) -> PrivacyLedger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_fits(charge: PrivacyCharge, orders: np.ndarray, neighbouring: Neighbouring) -> None:
    """A charge is composed on a ledger's ``orders`` for its ``neighbouring`` relation, or is an error."""
    if not np.array_equal(charge.orders, orders):
        raise InvalidValue(f"charge {charge.label!r} is not on this ledger's RDP orders")
    if charge.neighbouring != neighbouring:
        raise InvalidValue(
            f"charge {charge.label!r} holds for '{charge.neighbouring}' neighbours, this ledger composes "
            f"'{neighbouring}': bounds for different relations do not compose as one"
        )


# --- reading a ledger file without writing it ----------------------------------------------


@dataclass(frozen=True)
class LedgerSnapshot:
    """A ledger file as it stood when read: the settings declared when it was created, and
    its charges composed (in row-id order, as the ledger itself adds them)."""

    path: Path
    ledger_id: str  # random, written when the file was created
    delta: float
    budget: RenyiFilter | None  # None: a record-only ledger, no filter was in force; else the limit now
    neighbouring: Neighbouring
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
    contents = read_stored(path)
    declared = LedgerSettings.stored(path, contents.meta)
    totals = LedgerTotals(declared.orders, declared.delta, declared.neighbouring)
    for stored in contents.charges:
        totals.add(stored)
    return LedgerSnapshot(
        path, contents.ledger_id, declared.delta, current_budget(declared.budget, contents.changes),
        declared.neighbouring, declared.orders, totals.count, len(contents.answers), totals.spent(),
        totals.label_charges(), contents.entries, contents.changes,
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
    declared, entries = read_entries(Path(path))
    return [ChargeRecord(entry.id, entry.label, entry.created, entry.details,
                         PrivacyCharge(declared.orders, entry.rdp, extra_delta=entry.extra_delta,
                                       unbounded=entry.unbounded, reason=entry.reason, label=entry.label,
                                       neighbouring=declared.neighbouring))
            for entry in entries]
