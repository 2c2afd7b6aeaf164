"""An owner's policy on its own node, and the admission of a run against it.

The owner writes its policy (``conclave owner init``: ``$CONCLAVE_HOME/owners/<owner>.policy.json``
on its node): its lifetime (ε, δ) and neighbouring relation, where its ledger lives, the pipelines
and mechanisms it admits, the most one run may plan to spend and the paths of its data. A run's
config may ask for less than the policy allows, never more, and may not move the ledger; anything
else is refused in one line naming the owner (``OwnerRefused``). An owner with no policy keeps the
budget the run's config declares for it, and the run's report says so (``OwnerTerms.statement``).
Only the owner changes its budget, on its node (``change_budget``), as an entry of its ledger.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conclave.errors import InvalidValue, RunRefused, first_line
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter, choose_order
from conclave.privacy.accounting.guarantee import worst_case_guarantee
from conclave.privacy.accounting.ledger import BudgetChange, PrivacyLedger, read_ledger
from conclave.privacy.accounting.ledger_records import conclave_home

log = logging.getLogger(__name__)

POLICY_SUFFIX = ".policy.json"


class OwnerRefused(RunRefused, RuntimeError):
    """An owner's node refuses the run before anything is released — its policy, or its ledger's
    state (missing, damaged, held by another run, another budget) — in one line naming the owner."""


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
            raise InvalidValue(f"budget.epsilon must be a finite number > 0, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise InvalidValue(f"budget.delta must be in (0, 1), got {self.delta}")
        if not 0 <= self.reserved_delta < self.delta:
            raise InvalidValue(f"budget.reserved_delta must be in [0, delta), got {self.reserved_delta}")
        if self.neighbouring not in set(Neighbouring):
            raise InvalidValue(f"budget.neighbouring must be one of {sorted(n.value for n in Neighbouring)}, got "
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
            raise InvalidValue(f"owner {self.owner}: its policy's ledger folder must be an absolute path, got "
                             f"{self.ledger!r}")
        if self.max_run_epsilon is not None and not (self.max_run_epsilon > 0 and math.isfinite(self.max_run_epsilon)):
            raise InvalidValue(f"owner {self.owner}: max_run_epsilon must be a finite number > 0")

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
    """An owner's terms for one run, as its gateway decided them: the budget in force and where it
    comes from (``source``: "policy" on the owner's machine, or the run's "config" where it has
    none), and the lower lifetime ε this run asked to stay within (``cap``, None: the budget itself)."""

    owner: str
    source: str
    budget: OwnerBudget
    cap: float | None = None

    def cap_within(self, declared: RenyiFilter | None, path: Path) -> float | None:
        """The run's cap (the lower lifetime ε it asked for, None: none), once these terms are
        checked against the budget ``declared`` in the existing ledger at ``path``."""
        budget, source = self.budget, self.source
        if declared is None or (declared.delta, declared.reserved_delta) != (budget.delta, budget.reserved_delta) or (
                budget.order is not None and declared.order != budget.order):
            raise OwnerRefused(f"owner {self.owner}: its ledger {path} holds the lifetime budget "
                               f"{budget_text(declared)}; its {source} declares δ {budget.delta:g} "
                               f"(order {budget.order}): δ and order cannot change once spent on")
        if source == "policy":
            if declared.epsilon != budget.epsilon:
                raise OwnerRefused(f"owner {self.owner}: its policy says ε {budget.epsilon:g} but its ledger's budget "
                                   f"is ε {declared.epsilon:g}; a budget changes only by `conclave owner raise` or "
                                   "`lower` on its node, which records the change in the ledger")
            return self.cap
        if budget.epsilon > declared.epsilon:
            raise OwnerRefused(f"owner {self.owner}: the config declares a lifetime budget of ε {budget.epsilon:g} "
                               f"but its ledger holds ε {declared.epsilon:g}; a lifetime budget cannot change once "
                               "spent on, but by its owner on its node (`conclave owner init`, then `conclave owner "
                               "raise`)")
        return budget.epsilon if budget.epsilon < declared.epsilon else None


def budget_statement(source: str) -> str:
    """What it means that an owner's budget comes from ``source``: its "policy", or the run's "config"."""
    if source == "policy":
        return "the owner's policy on its node decides this budget; a run's config may ask for less, never more"
    return ("no policy on the owner's node: the run's config declares this budget, so whoever writes the config "
            "chooses it (the owner sets one with `conclave owner init` on its node)")


class OwnerAdmission:
    """Whether ``owner``'s policy on this node admits a run, and on which terms. ``asked``: the
    budget the run's config declares for the owner (None: none); ``data_paths``: the paths of
    the data the run names as the owner's."""

    def __init__(self, owner: str, asked: OwnerBudget | None = None, data_paths: tuple[str, ...] = ()) -> None:
        self.owner, self.asked, self._data_paths = owner, asked, data_paths

    def admit(self, request: RunRequest, planned: PrivacyCharge) -> OwnerTerms | None:
        """The owner's terms for ``request``, whose worst case is ``planned``, from its policy on
        this node (else the config's budget; None: no budget at all) — or ``OwnerRefused``, one
        line, when the policy does not admit the run as asked."""
        policy = OwnerPolicy.load(self.owner)
        self._check_data_is_its_own()
        if policy is None:
            return None if self.asked is None else OwnerTerms(self.owner, "config", self.asked)
        self._check_admitted(policy, request, planned)
        return OwnerTerms(self.owner, "policy", policy.budget(), self._asked_within(policy))

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


def budget_text(budget: RenyiFilter | None) -> str:
    return "none" if budget is None else f"ε {budget.epsilon:g} at δ {budget.delta:g} (order {budget.order:g})"


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
                               f"{budget_text(held)} for {snapshot.neighbouring} neighbours; declare that budget, "
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
                                   f"{budget_text(ledger.budget)}; restore the policy that matches its ledger")
            change = ledger.change_budget(epsilon)
    changed.save()
    log.info("owner %s: lifetime budget ε %g → %g", owner, policy.epsilon, epsilon)
    return changed, change
