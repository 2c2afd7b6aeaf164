"""An owner's lifetime budget, the policy that sets it, and the ledger of everything ever released
from its data.

The budget belongs to the data, and the owner decides it (its policy on its node); a run may ask
for less, never more. Every release from the data is charged here first, a Rényi filter across
runs (Feldman & Zrnic 2021, Thm 3.1). A missing, replaced or shortened ledger is refused, not
taken as a fresh budget; the data's HMAC fingerprint stays on the node. docs/privacy.md, "An
owner's lifetime budget", and docs/owners.md.
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
from typing import Any

import numpy as np

from conclave.errors import RunRefused, first_line
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter, choose_order, order_index, rdp_budget
from conclave.privacy.accounting.guarantee import worst_case_guarantee
from conclave.privacy.accounting.ledger import BudgetChange, BudgetExceeded, BudgetReport, PrivacyLedger, read_ledger
from conclave.privacy.accounting.ledger_records import conclave_home

log = logging.getLogger(__name__)

POLICY_SUFFIX = ".policy.json"


class OwnerRefused(RunRefused, RuntimeError):
    """An owner's node refuses the run before anything is released — its policy, or its ledger's
    state (missing, damaged, held by another run, another budget) — in one line naming the owner."""


class LedgerMissing(OwnerRefused):
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
    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE
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
        if self.neighbouring not in set(Neighbouring):
            raise ValueError(f"budget.neighbouring must be one of {sorted(n.value for n in Neighbouring)}, got "
                             f"{self.neighbouring!r}")
        object.__setattr__(self, "neighbouring", Neighbouring(self.neighbouring))  # as read from YAML or JSON
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
class OwnerPolicy:
    """What an owner allows on its data, written by the owner on its own node (``conclave owner
    init``) and read there only: the lifetime budget (``epsilon``, ``delta``, ``neighbouring``,
    ``order``, ``reserved_delta``, as ``OwnerBudget``), the folder of its ledger there
    (``ledger``, absolute), the ``pipelines`` and ``mechanisms`` it admits (empty: any), the
    most one run may plan to spend (``max_run_epsilon``, the planned worst case at the owner's
    δ: a floor on noise that holds for every mechanism), and the paths of its ``data`` on the
    node (a run that names them under another owner's name is refused)."""

    owner: str
    epsilon: float
    ledger: str
    delta: float = 1e-5
    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE
    order: float | None = None
    reserved_delta: float = 0.0
    pipelines: tuple[str, ...] = ()
    mechanisms: tuple[str, ...] = ()
    max_run_epsilon: float | None = None
    data: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("pipelines", "mechanisms", "data"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "neighbouring", self.budget().neighbouring)  # the budget's own checks, then typed
        if not Path(self.ledger).is_absolute():
            raise ValueError(f"owner {self.owner}: its policy's ledger folder must be an absolute path, got "
                             f"{self.ledger!r}")
        if self.max_run_epsilon is not None and not (self.max_run_epsilon > 0 and math.isfinite(self.max_run_epsilon)):
            raise ValueError(f"owner {self.owner}: max_run_epsilon must be a finite number > 0")

    def budget(self) -> OwnerBudget:
        return OwnerBudget(self.epsilon, self.delta, self.neighbouring, self.order, self.reserved_delta, self.ledger)

    @staticmethod
    def file(owner: str) -> Path:
        """Where ``owner``'s policy lives on this node."""
        return conclave_home() / "owners" / f"{owner}{POLICY_SUFFIX}"

    @classmethod
    def load(cls, owner: str) -> OwnerPolicy | None:
        """``owner``'s policy on this node, None without one; one that cannot be read is a refusal
        (an unreadable policy is not the absence of one)."""
        return _read_policy(cls.file(owner), owner)

    @classmethod
    def on_node(cls) -> list[OwnerPolicy]:
        """Every policy this node holds."""
        folder = conclave_home() / "owners"
        files = sorted(folder.glob(f"*{POLICY_SUFFIX}")) if folder.is_dir() else []
        return [_read_policy(f, f.name[: -len(POLICY_SUFFIX)]) for f in files]

    def save(self) -> Path:
        """Write the policy atomically (readers see the old file or the new one)."""
        target = self.file(self.owner)
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")
        os.replace(staged, target)
        return target

    def terms(self) -> dict[str, Any]:
        """What the driver may see of the policy: everything but the paths of the data."""
        return {"epsilon": self.epsilon, "delta": self.delta, "neighbouring": self.neighbouring,
                "order": self.order, "reserved_delta": self.reserved_delta, "ledger": self.ledger,
                "pipelines": list(self.pipelines) or "any", "mechanisms": list(self.mechanisms) or "any",
                "max_run_epsilon": self.max_run_epsilon}


def _read_policy(path: Path, owner: str) -> OwnerPolicy | None:
    if not path.exists():
        return None
    try:
        policy = OwnerPolicy(**json.loads(path.read_text()))
    except (OSError, TypeError, ValueError) as err:
        raise OwnerRefused(f"owner {owner}: its policy {path} cannot be read ({first_line(err)})") from None
    if policy.owner != owner:
        raise OwnerRefused(f"owner {owner}: its policy {path} is {policy.owner}'s")
    return policy


@dataclass(frozen=True)
class RunRequest:
    """What a run asks of each owner, checked against the owner's policy on its node: the run's
    name (tagged on every charge), its pipeline and the mechanisms it releases through (None and
    empty: not said — ``audit`` and the library do not say)."""

    run: str
    pipeline: str | None = None
    mechanisms: tuple[str, ...] = ()


@dataclass(frozen=True)
class OwnerTerms:
    """An owner's terms for one run, as its node decided them (public): the budget in force and
    where it comes from (``source``: "policy" on the owner's node, or the run's "config" where
    the node has none), the lower lifetime ε this run asked to stay within (``cap``, None: the
    budget itself), and the policy's public part."""

    owner: str
    source: str
    budget: OwnerBudget
    cap: float | None = None
    policy: dict[str, Any] | None = None

    @property
    def statement(self) -> str:
        if self.source == "policy":
            return "the owner's policy on its node decides this budget; a run's config may ask for less, never more"
        return ("no policy on the owner's node: the run's config declares this budget, so whoever writes the config "
                "chooses it (the owner sets one with `conclave owner init` on its node)")


@dataclass(frozen=True)
class LedgerIdentity:
    """Which ledger file (``path`` on the owner's node, and the identity written in it) holds an
    owner's budget, and how many entries it held when seen."""

    owner: str
    path: str
    ledger_id: str
    charges: int  # entries of its chain (charges and budget changes)


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
    """One owner's lifetime ledger, opened on the owner's node for one run: once ``open``, a
    ``privacy.accounting.ledger.Ledger`` whose refusals name the owner. ``asked``: the budget
    the run's config declares for the owner (None: none); the owner's policy on this node, if it
    has one, decides (``admit``)."""

    def __init__(self, owner: str, asked: OwnerBudget | None = None, data_paths: tuple[str, ...] = ()) -> None:
        self.owner, self.asked = owner, asked
        self.path = asked.ledger_path(owner) if asked is not None else None  # resolved here, on the owner's node
        self._data_paths = data_paths
        self.terms: OwnerTerms | None = None
        self._admitted = False
        self._ledger: PrivacyLedger | None = None
        self._cap: float | None = None  # the lower lifetime ε this run asked to stay within
        self._run = ""
        self._fingerprint = ""
        self.last_refusal: str | None = None  # the latest refusal's line

    # --- before the run: the owner's terms, its ledger's identity, the records of the others' --

    def admit(self, request: RunRequest, planned: PrivacyCharge) -> OwnerTerms | None:
        """The owner's terms for ``request``, whose worst case is ``planned``, from its policy on
        this node (else the config's budget; None: no budget at all) — or ``OwnerRefused``, one
        line, when the policy does not admit the run as asked."""
        policy = OwnerPolicy.load(self.owner)
        self._check_data_is_its_own()
        if policy is None:
            self.terms = None if self.asked is None else OwnerTerms(self.owner, "config", self.asked)
        else:
            self._check_admitted(policy, request, planned)
            self.terms = OwnerTerms(self.owner, "policy", policy.budget(), self._asked_within(policy), policy.terms())
        self._admitted = True
        self.path = None if self.terms is None else self.terms.budget.ledger_path(self.owner)
        return self.terms

    def ledger_file(self) -> str:
        return str(self.path)

    def identity(self) -> LedgerIdentity | None:
        """This owner's ledger as it is on disk (None: no file), read without writing."""
        if self._ledger is not None:
            return LedgerIdentity(self.owner, str(self.path), self._ledger_id(), self._entries())
        if self.path is None or not self.path.exists():
            return None
        snapshot = read_ledger(self.path)
        return LedgerIdentity(self.owner, str(self.path), snapshot.ledger_id, snapshot.entries)

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
        staged = target.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(json.dumps([dataclasses.asdict(r) for r in records.values()], indent=1))
        os.replace(staged, target)

    # --- the run ---------------------------------------------------------------------------

    def open(self, planned: PrivacyCharge, run: str) -> LedgerIdentity:
        """Open (or create, with the lifetime filter fixed from ``planned``) the ledger for
        ``run``. A file whose budget is not the one in force is refused: a lifetime budget
        changes only by its owner, on its node (``change_budget``)."""
        if not self._admitted:
            self.admit(RunRequest(run), planned)
        if self.terms is None:
            raise OwnerRefused(f"owner {self.owner}: no lifetime budget (no policy on its node, none in the config)")
        budget = self.terms.budget
        if planned.neighbouring != budget.neighbouring:
            raise OwnerRefused(f"owner {self.owner}: its budget is for {budget.neighbouring} neighbours, the run's "
                               f"releases are bounded for {planned.neighbouring}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            ledger = PrivacyLedger.open_existing(self.path, keep_record=True)
            try:
                self._cap = self._within_ledger(ledger.budget)
            except BaseException:
                ledger.close()
                raise
        else:
            ledger = PrivacyLedger(self.path, budget.delta, budget.filter(planned), neighbouring=budget.neighbouring,
                                   keep_record=True)
            self._cap = self.terms.cap
        self._ledger, self._run = ledger, run
        self._fingerprint = self._fingerprint_data()
        return LedgerIdentity(self.owner, str(self.path), self._ledger_id(), self._entries())

    # --- the Ledger protocol (``privacy.accounting.ledger``), once open ---------------------

    @property
    def delta(self) -> float:
        return self._open().delta

    @property
    def neighbouring(self) -> Neighbouring:
        return self._open().neighbouring

    @property
    def orders(self) -> np.ndarray:
        return self._open().orders

    @property
    def budget(self) -> RenyiFilter | None:
        return self._open().budget

    def refusal(self, charge: PrivacyCharge) -> str | None:
        """None when ``charge`` fits the lifetime budget now (and the run's lower cap), else the
        refusal in one line naming the owner and what its lifetime budget has left."""
        refused = self._cap_refusal(charge)
        if refused is None and not self._open().can_afford(charge):
            refused = self._refusal_line()
        if refused is not None:
            self.last_refusal = refused
        return refused

    def can_afford(self, charge: PrivacyCharge) -> bool:
        return self.refusal(charge) is None

    def charge(self, charge: PrivacyCharge, worst_case: PrivacyCharge | None = None) -> BudgetReport:
        """Record ``charge`` durably, tagged with the run and the data's fingerprint, or raise
        ``BudgetExceeded`` with the refusal in one line (naming the owner and what its lifetime
        budget has left) when spent + ``worst_case`` would pass the budget — nothing is
        recorded then. (The actor on the owner's node answers the driver with the line as a
        value, ``actors.owner_ledger``.)"""
        capped = self._cap_refusal(worst_case if worst_case is not None else charge)
        if capped is not None:
            self.last_refusal = capped
            raise BudgetExceeded(capped)
        tagged = dataclasses.replace(charge, details={**charge.details, "run": self._run,
                                                      "fingerprint": self._fingerprint})
        try:
            return self._open().charge(tagged, worst_case=worst_case)
        except BudgetExceeded:
            self.last_refusal = self._refusal_line()
            raise BudgetExceeded(self.last_refusal) from None

    def report(self) -> BudgetReport:
        return self._open().report()

    def spent(self) -> PrivacyCharge:
        return self._open().spent()

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    # --- internals -------------------------------------------------------------------------

    def _check_data_is_its_own(self) -> None:
        """Refuse a run that names another owner's data (a path its policy on this node guards)
        under this owner's name: renaming an owner is not a fresh budget."""
        mine = [Path(p).expanduser().resolve() for p in self._data_paths]
        for policy in OwnerPolicy.on_node():
            if policy.owner == self.owner:
                continue
            for guarded in (Path(p) for p in policy.data):
                for path in mine:
                    if path == guarded or guarded in path.parents or path in guarded.parents:
                        raise OwnerRefused(f"owner {self.owner}: its data {path} is {policy.owner}'s, whose policy on "
                                           f"this node governs it; a run names that data as owner {policy.owner}")

    def _check_admitted(self, policy: OwnerPolicy, request: RunRequest, planned: PrivacyCharge) -> None:
        """The pipelines, mechanisms and per-run ceiling the policy sets."""
        where = "(its policy on its node)"
        if policy.pipelines and request.pipeline not in policy.pipelines:
            asked = "does not name its pipeline" if request.pipeline is None else f"is {request.pipeline}"
            raise OwnerRefused(f"owner {self.owner} admits the pipelines {', '.join(policy.pipelines)} {where}; "
                               f"run '{request.run}' {asked}")
        if policy.mechanisms:
            outside = [m for m in request.mechanisms if m not in policy.mechanisms]
            if outside or not request.mechanisms:
                asked = ", ".join(outside) if outside else "mechanisms it does not name"
                raise OwnerRefused(f"owner {self.owner} admits the mechanisms {', '.join(policy.mechanisms)} {where}; "
                                   f"run '{request.run}' releases through {asked}")
        if policy.max_run_epsilon is not None:
            worst = worst_case_guarantee(planned, policy.delta).epsilon
            if not worst <= policy.max_run_epsilon:
                raise OwnerRefused(f"owner {self.owner} allows at most ε {policy.max_run_epsilon:g} per run {where}; "
                                   f"run '{request.run}' plans up to ε {worst:.4g} at δ {policy.delta:g}")

    def _asked_within(self, policy: OwnerPolicy) -> float | None:
        """The config's budget for this owner must ask for no more than the policy allows, in the
        same ledger: the lower ε it asks for (None: none lower)."""
        asked = self.asked
        if asked is None:
            return None
        kept = Path(policy.ledger).resolve()
        if asked.directory is not None and Path(asked.directory).expanduser().resolve() != kept:
            raise OwnerRefused(f"owner {self.owner}: the config names its ledger folder {asked.directory}, but its "
                               f"policy on its node keeps it at {policy.ledger}; a run cannot move an owner's ledger")
        mine = (policy.delta, policy.neighbouring, policy.reserved_delta)
        if (asked.delta, asked.neighbouring, asked.reserved_delta) != mine or (
                asked.order is not None and asked.order != policy.order):
            raise OwnerRefused(f"owner {self.owner}: the config declares another budget (δ {asked.delta:g}, "
                               f"{asked.neighbouring}, order {asked.order}) than its policy (δ {policy.delta:g}, "
                               f"{policy.neighbouring}, order {policy.order}); a run may ask for a lower ε only")
        if asked.epsilon > policy.epsilon:
            raise OwnerRefused(f"owner {self.owner}: the config asks for a lifetime budget of ε {asked.epsilon:g}, "
                               f"more than the ε {policy.epsilon:g} its policy allows; a run may ask for less, "
                               "never more")
        return asked.epsilon if asked.epsilon < policy.epsilon else None

    def _within_ledger(self, declared: RenyiFilter | None) -> float | None:
        """Check the terms against the budget the existing ledger holds now; the run's cap."""
        budget, source = self.terms.budget, self.terms.source
        if declared is None or (declared.delta, declared.reserved_delta) != (budget.delta, budget.reserved_delta) or (
                budget.order is not None and declared.order != budget.order):
            raise OwnerRefused(f"owner {self.owner}: its ledger {self.path} holds the lifetime budget "
                               f"{_budget_text(declared)}; its {source} declares δ {budget.delta:g} "
                               f"(order {budget.order}): δ and order cannot change once spent on")
        if source == "policy":
            if declared.epsilon != budget.epsilon:
                raise OwnerRefused(f"owner {self.owner}: its policy says ε {budget.epsilon:g} but its ledger's budget "
                                   f"is ε {declared.epsilon:g}; a budget changes only by `conclave owner raise` or "
                                   "`lower` on its node, which records the change in the ledger")
            return self.terms.cap
        if budget.epsilon > declared.epsilon:
            raise OwnerRefused(f"owner {self.owner}: the config declares a lifetime budget of ε {budget.epsilon:g} "
                               f"but its ledger holds ε {declared.epsilon:g}; a lifetime budget cannot change once "
                               "spent on, but by its owner on its node (`conclave owner init`, then `conclave owner "
                               "raise`)")
        return budget.epsilon if budget.epsilon < declared.epsilon else None

    def _cap_refusal(self, charge: PrivacyCharge) -> str | None:
        """The refusal of ``charge`` by the lower lifetime ε this run asked for, or None."""
        if self._cap is None:
            return None
        report = self._open().report()
        budget = report.budget
        allowed = max(0.0, rdp_budget(self._cap, budget.curve_delta, budget.order))
        if report.rdp_at_budget_order + charge.rdp[order_index(budget.order, charge.orders)] <= allowed * (1 + 1e-12):
            return None
        left = max(0.0, allowed - report.rdp_at_budget_order)
        return (f"owner {self.owner}'s lifetime budget, kept within ε {self._cap:g} of its ε {budget.epsilon:g} as "
                f"this run asks, refuses it: {left:.4g} of {allowed:.4g} left at Rényi order {budget.order:g} (spent "
                f"so far ε {report.epsilon_spent:.4g}, {report.charges} charges)")

    def _refusal_line(self) -> str:
        """One line: whose lifetime budget refuses, and what it has left."""
        report = self._open().report()
        left = report.remaining_rdp
        return (f"owner {self.owner}'s lifetime budget ε {report.epsilon_limit:g} at δ {report.delta:g} refuses it: "
                f"{left:.4g} of {report.budget.rdp_budget:.4g} left at Rényi order {report.budget.order:g} "
                f"(spent so far ε {report.epsilon_spent:.4g}, {report.charges} charges)")

    def _open(self) -> PrivacyLedger:
        if self._ledger is None:
            raise RuntimeError(f"owner {self.owner}: the ledger is not open")
        return self._ledger

    def _ledger_id(self) -> str:
        return self._open().ledger_id

    def _entries(self) -> int:
        report = self._open().report()
        return report.charges + len(report.changes)

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


# --- the owner's own actions, on its node (``conclave owner``) ------------------------------


def write_policy(policy: OwnerPolicy) -> Path:
    """Write ``policy`` on this node. Its budget must be the one its ledger holds, if one exists
    (an owner adopting a ledger its runs' configs made), and a policy already there may be
    rewritten only with the same budget: the budget changes by ``change_budget``."""
    old = OwnerPolicy.load(policy.owner)
    if old is not None and old.budget() != policy.budget():
        raise OwnerRefused(f"owner {policy.owner}: its policy {OwnerPolicy.file(policy.owner)} already declares "
                           f"ε {old.epsilon:g} at δ {old.delta:g} in {old.ledger}; change ε with `conclave owner "
                           "raise` or `lower` (recorded in its ledger), the rest is fixed once declared")
    path = policy.budget().ledger_path(policy.owner)
    if path.exists():
        snapshot = read_ledger(path)
        held, budget = snapshot.budget, policy.budget()
        if held is None or (held.epsilon, held.delta, held.reserved_delta) != (
                budget.epsilon, budget.delta, budget.reserved_delta) or snapshot.neighbouring != budget.neighbouring \
                or (budget.order is not None and held.order != budget.order):
            raise OwnerRefused(f"owner {policy.owner}: its ledger {path} holds the lifetime budget "
                               f"{_budget_text(held)} for {snapshot.neighbouring} neighbours; declare that budget, "
                               "then raise or lower ε")
    return policy.save()


def change_budget(owner: str, epsilon: float) -> tuple[OwnerPolicy, BudgetChange | None]:
    """The owner changes its lifetime ε on its node: the policy is rewritten and, once a ledger
    exists, the change is an entry of its chain (when, from, to). Refused while a run holds the
    ledger (``LedgerInUse``). Returns the new policy and the ledger's entry (None: no ledger yet,
    nothing spent, so the new budget is simply the one declared)."""
    policy = OwnerPolicy.load(owner)
    if policy is None:
        raise OwnerRefused(f"owner {owner} has no policy on this node ({OwnerPolicy.file(owner)}): write one with "
                           "`conclave owner init` first")
    changed = dataclasses.replace(policy, epsilon=float(epsilon))  # checks the new budget
    path = policy.budget().ledger_path(owner)
    change = None
    if path.exists():
        with PrivacyLedger.open_existing(path, keep_record=True) as ledger:
            if ledger.budget is None or ledger.budget.epsilon != policy.epsilon:
                raise OwnerRefused(f"owner {owner}: its policy says ε {policy.epsilon:g} but its ledger's budget is "
                                   f"{_budget_text(ledger.budget)}; restore the policy that matches its ledger")
            change = ledger.change_budget(epsilon)
    changed.save()
    log.info("owner %s: lifetime budget ε %g → %g", owner, policy.epsilon, epsilon)
    return changed, change


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
        staged = self.path.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(json.dumps([dataclasses.asdict(r) for r in records.values()], indent=1))
        os.replace(staged, self.path)
