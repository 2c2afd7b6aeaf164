"""Each owner's policy and lifetime ledger (``privacy.accounting.owner_policy``, ``owner_ledger``)
in a Ray actor on the owner's own node, and the driver's handle on all of them for one run.

The actor takes no CPU and is pinned to the owner's node: by its node labels on a cluster, by
the node that declares its custom resources otherwise (the owner's resource amounts belong to
its teachers and shard actors, so the ledger does not take a share of them). Every owner of a run
gets one, with a budget in its config or not: the owner's policy is on its node, and a config
that leaves out the budget does not leave out the policy. Owners with neither have their actor
stopped at once. Every charge of a run goes to every owner's ledger with a budget — any owner's
record can be the one that differs between neighbouring datasets, so each release costs each
owner its full charge — and one owner's refusal stops the release.

The actor answers every call with a value (``NodeAnswer``): a refusal on the owner's node — its
policy, its ledger damaged, missing, held by another run, another budget, a full budget — comes
back as one line naming the owner, raised on the driver as ``OwnerRefused`` or
``BudgetExceeded``. Ray's error text (a remote traceback, "Unhandled error" for the other owners'
replies) never reaches the user.
"""
from __future__ import annotations

import logging
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from conclave.actors.placement import Placement, PlacementError
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.ledger import BudgetExceeded, BudgetReport
from conclave.privacy.accounting.ledger_records import HOME_VARIABLE
from conclave.privacy.accounting.ledger_identity import IdentityRecords, LedgerIdentity, check_not_missing
from conclave.privacy.accounting.owner_ledger import OwnerLedger
from conclave.privacy.accounting.owner_policy import OwnerAdmission, OwnerBudget, OwnerRefused, OwnerTerms, RunRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeAnswer:
    """An owner node's reply: ``value``, or a refusal (``kind`` "refused", "budget" or "failed",
    and its ``line``, naming the owner)."""

    value: Any = None
    kind: str | None = None
    line: str = ""


class OwnerNode:
    """The owner's policy, ledger and records of its peers on its node, answering the driver's
    calls (``call``: one of ``CALLS``, "admit" first) in values (``NodeAnswer``)."""

    CALLS = frozenset({"admit", "ledger_file", "identity", "peer_records", "note_peers", "open", "refusal", "charge",
                       "report", "close"})

    def __init__(self, owner: str, asked: OwnerBudget | None, data_paths: tuple[str, ...]) -> None:
        self.owner, self._data_paths = owner, data_paths
        self._admission = OwnerAdmission(owner, asked, data_paths)
        self._ledger: OwnerLedger | None = None  # once admitted with a budget

    def call(self, method: str, *args: Any) -> NodeAnswer:
        try:
            if method not in self.CALLS:
                raise RuntimeError(f"owner {self.owner}: its node answers no call '{method}'")
            return NodeAnswer(getattr(self, method)(*args))
        except BaseException as err:  # noqa: BLE001 - every refusal is a value, one line naming the owner
            return _refusal(self.owner, err)

    def admit(self, request: RunRequest, planned: PrivacyCharge) -> OwnerTerms | None:
        self._check_environment()
        terms = self._admission.admit(request, planned)
        self._ledger = None if terms is None else OwnerLedger(terms, self._data_paths)
        return terms

    def ledger_file(self) -> str:
        return str(self._admitted().path)

    def identity(self) -> LedgerIdentity | None:
        return self._admitted().identity()

    def peer_records(self) -> list[LedgerIdentity]:
        return IdentityRecords.of_peers(self.owner, self._admitted().path).load()

    def note_peers(self, seen: list[LedgerIdentity]) -> None:
        IdentityRecords.of_peers(self.owner, self._admitted().path).note(seen)

    def open(self, planned: PrivacyCharge, run: str) -> LedgerIdentity:
        return self._admitted().open(planned, run)

    def refusal(self, charge: PrivacyCharge) -> str | None:
        return self._admitted().refusal(charge)

    def charge(self, charge: PrivacyCharge, worst_case: PrivacyCharge | None = None) -> BudgetReport:
        return self._admitted().charge(charge, worst_case)

    def report(self) -> BudgetReport:
        return self._admitted().report()

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()

    def _admitted(self) -> OwnerLedger:
        if self._ledger is None:
            raise OwnerRefused(f"owner {self.owner}: no lifetime budget (no policy on its node, none in the config)")
        return self._ledger

    def _check_environment(self) -> None:
        """The node's own Conclave folder holds the owner's policy and ledger: a run's
        ``runtime_env`` that sets another would point this actor at a folder the run chose."""
        env_vars = ray.get_runtime_context().runtime_env.get("env_vars") or {}
        if HOME_VARIABLE in env_vars:
            raise OwnerRefused(f"owner {self.owner}: the run's runtime_env sets {HOME_VARIABLE}, which would choose "
                               "where this node's policy and ledger are read; remove it")


def _refusal(owner: str, err: BaseException) -> NodeAnswer:
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    if isinstance(err, BudgetExceeded):
        return NodeAnswer(kind="budget", line=line)
    if isinstance(err, OwnerRefused):
        return NodeAnswer(kind="refused", line=line)
    named = line if line.startswith(f"owner {owner}") else f"owner {owner}: {line}"
    if isinstance(err, (ValueError, RuntimeError, OSError, sqlite3.Error)):  # damaged, in use, unreadable, no disk
        return NodeAnswer(kind="refused", line=named)
    return NodeAnswer(kind="failed", line=f"{named} ({type(err).__name__} on its node)")


OwnerNodeActor = ray.remote(num_cpus=0, max_restarts=0)(OwnerNode)


@dataclass(frozen=True)
class OwnerAccount:
    """An owner of a run: its name, the budget its config declares (None: none; its policy on its
    node may still set one), placement and the paths of its data on its node (for the policy's
    check that the data is its own, and the fingerprint, which stays there)."""

    name: str
    budget: OwnerBudget | None
    placement: Placement
    data_paths: tuple[str, ...] = ()


def owner_node(account: OwnerAccount) -> str:
    """The id of the node ``account``'s ledger actor lives on, the owner's: the node that
    declares the owner's custom resources, else the one carrying its labels, else (an owner
    pinned by neither, or labels on a one-node cluster, which does not use them) this node."""
    alive = [node for node in ray.nodes() if node.get("Alive")]
    wanted, labels = set(account.placement.resources), account.placement.labels
    if wanted:
        nodes = sorted(n["NodeID"] for n in alive if wanted <= set(n.get("Resources", {})))
    elif labels:
        nodes = sorted(n["NodeID"] for n in alive if labels.items() <= dict(n.get("Labels", {})).items())
        if not nodes and len(alive) == 1:
            nodes = [ray.get_runtime_context().get_node_id()]
    else:
        nodes = [ray.get_runtime_context().get_node_id()]
    if not nodes:
        raise PlacementError(f"owner {account.name}: no node declares {sorted(wanted) or labels}, so its ledger "
                             "has no node to live on")
    return nodes[0]


class OwnerLedgers:
    """The owners' lifetime ledgers of one run, each in its actor on its owner's node."""

    def __init__(self, handles: dict[str, ray.actor.ActorHandle], nodes: dict[str, str]) -> None:
        self._handles = handles
        self.nodes = nodes  # owner → the id of the node its ledger lives on
        self.terms: dict[str, OwnerTerms] = {}  # owner → its terms for the run, as its node decided them

    @classmethod
    def start(cls, accounts: Sequence[OwnerAccount], planned: PrivacyCharge, request: RunRequest,
              records: Sequence[LedgerIdentity] = ()) -> OwnerLedgers | None:
        """Ask every owner's node for its terms for ``request`` (its policy, else the config's
        budget), then open the ledger of every owner that has a budget, refusing
        (``OwnerRefused``, ``LedgerMissing``) any that is missing, replaced or shorter than a
        record kept by the driver (``records``) or by another owner's node says; a new ledger's
        filter is fixed from ``planned``. None when no owner has a budget."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = {}
        for account in accounts:
            try:
                nodes[account.name] = owner_node(account)
            except PlacementError:
                if account.budget is not None:
                    raise
                # no node holds its data nor a policy for it: the run's placement check refuses it
        accounts = [a for a in accounts if a.name in nodes]
        handles = {a.name: OwnerNodeActor.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[a.name], soft=False)).remote(
            a.name, a.budget, a.data_paths) for a in accounts}
        ledgers = cls(handles, nodes)
        try:
            terms = ledgers._ask("admit", request, planned)
            for name in [n for n, t in terms.items() if t is None]:  # no policy and no budget: nothing to keep
                ray.kill(ledgers._handles.pop(name))
                ledgers.nodes.pop(name)
            if not ledgers._handles:
                return None
            ledgers.terms = {name: terms[name] for name in ledgers._handles}
            paths = ledgers._ask("ledger_file")
            found = ledgers._ask("identity")
            kept = [("the driver", r) for r in records]
            for name, peers in ledgers._ask("peer_records").items():
                kept += [(f"{name}'s node", r) for r in peers]
            for name in ledgers.names:
                check_not_missing(name, paths[name], found[name], kept)
            ledgers._ask("open", planned, request.run)
            ledgers.note_peers()
        except BaseException:
            ledgers.close()
            raise
        return ledgers

    @property
    def names(self) -> list[str]:
        return list(self._handles)

    def identities(self) -> list[LedgerIdentity]:
        return [i for i in self._ask("identity").values() if i is not None]

    def note_peers(self) -> None:
        """Every owner's node keeps what it saw of the others' ledgers."""
        self._ask("note_peers", self.identities())

    def refusal(self, charge: PrivacyCharge) -> str | None:
        """The first owner's refusal of ``charge``, in one line, or None when all would accept it."""
        return next((r for r in self._ask("refusal", charge).values() if r is not None), None)

    def charge(self, charge: PrivacyCharge, worst_case: PrivacyCharge | None = None) -> None:
        """Charge every owner at once. One refusal raises ``BudgetExceeded`` (its message names
        the owner); owners that accepted keep the charge — more than was released, never less."""
        self._ask("charge", charge, worst_case)

    def reports(self) -> dict[str, BudgetReport]:
        return self._ask("report")

    def close(self) -> None:
        """Keep the peers' records, close every ledger and stop the actors."""
        if self._handles:
            try:
                self.note_peers()
            except (ray.exceptions.RayError, OwnerRefused, RuntimeError) as err:  # its own ledger is on its disk
                log.warning("owners' records of each other's ledgers not updated: %s", err)
        try:
            self._ask("close")
        except (ray.exceptions.RayError, OwnerRefused, RuntimeError) as err:  # committed charges are on disk already
            log.warning("an owner's ledger did not close cleanly: %s", err)
        for handle in self._handles.values():
            ray.kill(handle)
        self._handles = {}

    def _ask(self, method: str, *args: Any) -> dict[str, Any]:
        """Every owner's answer to ``method``: owner → value. The first refusal (in the owners'
        order) is raised: ``BudgetExceeded`` for a budget, ``OwnerRefused`` for the rest."""
        names = list(self._handles)
        answers = ray.get([self._handles[n].call.remote(method, *args) for n in names])
        for answer in answers:
            if answer.kind == "budget":
                raise BudgetExceeded(answer.line)
            if answer.kind == "refused":
                raise OwnerRefused(answer.line)
            if answer.kind is not None:
                raise RuntimeError(answer.line)
        return {name: answer.value for name, answer in zip(names, answers)}
