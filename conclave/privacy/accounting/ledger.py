"""The ledger: what every release is charged to before it leaves.

``ChargeGate`` is what a release is checked against and charged to: any ``Ledger``, or several
as one (NearPrivate's run and model ledgers, ``cluster.active_learning.BothLedgers``). ``Ledger``
is the one protocol of a run's or a service's ledger (``PrivacyLedger``) and an owner's lifetime
ledger (``owner_ledger.OwnerLedger``, kept by its gateway): ask (``refusal``), charge (``charge``:
recorded durably before anything is released, or refused with ``BudgetExceeded``, recording
nothing), read (``report``, ``spent``).
``AnsweringLedger`` adds the answers a labelling service repeats, free. As in dp_accounting's
``PrivacyAccountant`` and Opacus's ``IAccountant``, the math is kept apart from the state.

A ``PrivacyLedger`` is three parts behind the protocol: the filter's math (``filter.RenyiFilter``:
refuse what would pass the budget at one fixed Rényi order), the durable store (``ledger_store``:
one SQLite file, one writer, a checksum chain, its length kept outside the file) and the answer
record (the answers a charge pays for, written in the same transaction as the charge).
"""
from __future__ import annotations

import dataclasses
import math
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
from conclave.privacy.accounting.pld import GaussianSteps
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp

# The store's entry label and errors belong to the ledger's contract: callers catch them here.
__all__ = [
    "BUDGET_CHANGE", "AnsweringLedger", "BudgetChange", "BudgetExceeded", "BudgetReport", "ChargeGate", "ChargeRecord",
    "Ledger",
    "LedgerDamaged", "LedgerInUse", "LedgerSnapshot", "LedgerUnwritable", "PrivacyLedger", "current_budget",
    "largest_budget", "read_history", "read_ledger",
]


class BudgetExceeded(ConclaveError):
    """A charge was refused: it would pass the run's privacy budget. Nothing was recorded."""

    exit_code = 4

    def run_line(self, run: str) -> str:
        line = first_line(self)
        where = ("" if line.startswith("owner ") else
                 " (the ledger in its results folder keeps what earlier runs on the same data spent)")
        return f"run '{run}' refused by a privacy ledger: {line}{where}"


@dataclass(frozen=True)
class BudgetReport:
    """What a ledger holds now. ``epsilon_spent`` composes the charges at their best order with the
    tight conversion (Balle et al. 2020, Thm 21) at δ − Σ extra δ: a function of what was
    released, so it may be shown, but an odometer reading, not the guarantee (``guarantee``)."""

    epsilon_spent: float  # realised spend at its best order (inf once an unbounded charge was accepted)
    delta: float  # total δ: curve δ + Σ extra δ (= the configured δ)
    order: float | None  # RDP order attaining epsilon_spent; None when nothing or something unbounded was spent
    charges: int
    bounded: bool  # False once an unbounded charge (e.g. NZC) has been recorded
    by_label: dict[str, float]  # ε each label would cost alone, at the same δ split
    neighbouring: Neighbouring
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

    def record_answers(self, answers: dict[bytes, int]) -> None:
        """Record answers an earlier charge already paid for."""
        ...

    def answers(self) -> dict[bytes, int]:
        """Every answer on record."""
        ...

    def worst_case_spent(self) -> PrivacyCharge:
        """Every charge recorded so far at the worst case it was checked against, composed."""
        ...


class _Totals:
    """Running sums of the charges read so far, always added in row-id order so that a
    reopened ledger rebuilds bit-identical totals."""

    def __init__(self, size: int) -> None:
        self.count = 0
        self.rdp = np.zeros(size)
        self.extra_delta = 0.0
        self.unbounded = False
        self.by_label: dict[str, tuple[np.ndarray, float, bool]] = {}
        # The Gaussian releases of every charge so far, while each was one (``PrivacyCharge.pld``).
        self.plan: tuple[GaussianSteps, ...] | None = ()
        # Every charge at the worst case it was checked against (its own where none was given).
        self.worst = WorstCase(np.zeros(size), 0.0, False)

    def add(self, charge: StoredCharge) -> None:
        self.count += 1
        worst = charge.worst
        if worst is None:  # the charge is its own worst case
            worst = WorstCase(charge.rdp, charge.extra_delta, charge.unbounded)
        self.worst = WorstCase(self.worst.rdp + worst.rdp, self.worst.extra_delta + worst.extra_delta,
                               self.worst.unbounded or worst.unbounded)
        self.plan = None if self.plan is None or charge.plan is None else self.plan + charge.plan
        self.rdp = self.rdp + charge.rdp
        self.extra_delta += charge.extra_delta
        self.unbounded = self.unbounded or charge.unbounded
        curve, extra, unb = self.by_label.get(charge.label, (np.zeros_like(charge.rdp), 0.0, False))
        self.by_label[charge.label] = (curve + charge.rdp, extra + charge.extra_delta, unb or charge.unbounded)


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
        self._cached_report: tuple[int, BudgetReport] | None = None
        self.last_refusal: str | None = None  # the latest refusal's line (why a run stopped)
        self._store = LedgerStore(path, LedgerSettings(self.delta, budget, neighbouring, self.orders), keep_record)
        self._totals = _Totals(self.orders.size)
        for stored in self._store.opened.charges:
            self._totals.add(stored)
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
        self._check_charge(charge)
        if charge.label == BUDGET_CHANGE:
            raise InvalidValue(f"{BUDGET_CHANGE!r} labels the budget's changes, not a charge")
        if worst_case is not None:
            self._check_charge(worst_case)
            if np.any(charge.rdp > worst_case.rdp * (1 + 1e-9) + 1e-15) or charge.extra_delta > worst_case.extra_delta * (
                1 + 1e-9
            ) or (charge.unbounded and not worst_case.unbounded):
                raise InvalidValue(f"charge {charge.label!r} exceeds the worst case it was checked against")
        with self._lock:
            self._store.check_open()
            refused = self._refusal(worst_case if worst_case is not None else charge)
            if refused is not None:
                self.last_refusal = refused
                raise BudgetExceeded(refused)
            worst = WorstCase.beyond(charge, worst_case)
            self._store.append_charge(charge, answers or {}, worst)
            # Only after COMMIT succeeded does the new row enter the running totals.
            self._totals.add(StoredCharge(charge.label, np.asarray(charge.rdp, dtype="<f8"), float(charge.extra_delta),
                                          bool(charge.unbounded), charge.pld, worst))
            return self._report()

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
        self._check_charge(charge)
        with self._lock:
            self._store.check_open()
            refused = self._refusal(charge)
            if refused is not None:
                self.last_refusal = refused
            return refused

    def report(self) -> BudgetReport:
        with self._lock:
            self._store.check_open()
            return self._report()

    def record_answers(self, answers: dict[bytes, int]) -> None:
        """Record answers whose cost an earlier charge already paid (e.g. inside an open
        stability run), so that a restart repeats them too."""
        with self._lock:
            self._store.add_answers(answers)

    def answers(self) -> dict[bytes, int]:
        """Every answer on record (key → released value), checked against the chain."""
        with self._lock:
            return self._store.answers()

    def spent(self) -> PrivacyCharge:
        """Everything recorded so far as one composed charge (curve, Σ extra δ, unbounded)."""
        with self._lock:
            self._store.check_open()
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

    def worst_case_spent(self) -> PrivacyCharge:
        """Every charge recorded so far at the worst case it was checked against (its own where
        none was given), composed: what the run's guarantee composes where its plan no longer
        covers what it charged (``guarantee.run_worst_case``)."""
        with self._lock:
            self._store.check_open()
            worst = self._totals.worst
            return PrivacyCharge(self.orders, worst.rdp.copy(), extra_delta=worst.extra_delta,
                                 unbounded=worst.unbounded,
                                 reason="an unbounded charge was recorded" if worst.unbounded else "",
                                 label="charged at worst case", neighbouring=self.neighbouring)

    def close(self) -> None:
        with self._lock:
            self._store.close()

    def __enter__(self) -> PrivacyLedger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------

    def _check_charge(self, charge: PrivacyCharge) -> None:
        if not np.array_equal(charge.orders, self.orders):
            raise InvalidValue(f"charge {charge.label!r} is not on this ledger's RDP orders")
        if charge.neighbouring != self.neighbouring:
            raise InvalidValue(
                f"charge {charge.label!r} holds for '{charge.neighbouring}' neighbours, this ledger composes "
                f"'{self.neighbouring}': bounds for different relations do not compose as one"
            )

    def _refusal(self, charge: PrivacyCharge) -> str | None:
        """The filter's verdict on ``charge`` after what was spent (None without a budget)."""
        if self.budget is None:
            return None
        spent = self._totals
        return self.budget.refusal(spent.rdp[self._budget_index], spent.extra_delta, charge)

    def _epsilon(self, rdp: np.ndarray, extra_delta: float, unbounded: bool) -> tuple[float, float | None]:
        if unbounded or extra_delta >= self.delta:
            return math.inf, None
        epsilon, order = epsilon_from_rdp(self.orders, rdp, self.delta - extra_delta, conversion="tight")
        return epsilon, (None if math.isnan(order) else order)

    def _report(self) -> BudgetReport:
        """The report for the entries so far; computed once per new entry (the conversions to
        ε are most of a read's cost, and a label call reads the budget several times)."""
        spent = self._totals
        if self._cached_report is not None and self._cached_report[0] == self._store.entries:
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
        self._cached_report = (self._store.entries, report)
        return report


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
    totals = _Totals(declared.orders.size)
    for stored in contents.charges:
        totals.add(stored)

    def composed(rdp: np.ndarray, extra: float, unbounded: bool, label: str, plan=None) -> PrivacyCharge:
        return PrivacyCharge(declared.orders, rdp, extra_delta=extra, unbounded=unbounded,
                             reason="an unbounded charge was recorded" if unbounded else "", label=label,
                             neighbouring=declared.neighbouring, pld=plan)

    return LedgerSnapshot(
        path, contents.ledger_id, declared.delta, current_budget(declared.budget, contents.changes),
        declared.neighbouring, declared.orders, totals.count, len(contents.answers),
        composed(totals.rdp, totals.extra_delta, totals.unbounded, "spent", totals.plan if totals.count else None),
        {label: composed(*sums, label) for label, sums in totals.by_label.items()},
        contents.entries, contents.changes,
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
