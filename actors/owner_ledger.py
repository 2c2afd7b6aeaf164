"""Each owner's lifetime ledger (``privacy.accounting.owner_ledger``) in a Ray actor on the
owner's own node, and the driver's handle on all of them for one run.

The actor takes no CPU and is pinned to the owner's node: by its node labels on a cluster, by
the node that declares its custom resources otherwise (the owner's resource amounts belong to
its teachers and shard actors, so the ledger does not take a share of them). Every charge of a
run goes to every owner's ledger with a budget — any owner's record can be the one that differs
between neighbouring datasets, so each release costs each owner its full charge — and one
owner's refusal stops the release.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import ray

from conclave.actors.placement import Placement, PlacementError
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.ledger import BudgetExceeded, BudgetReport
from conclave.privacy.accounting.owner_ledger import LedgerIdentity, OwnerBudget, OwnerLedger, check_not_missing

log = logging.getLogger(__name__)

OwnerLedgerActor = ray.remote(num_cpus=0, max_restarts=0)(OwnerLedger)


@dataclass(frozen=True)
class OwnerAccount:
    """An owner with a lifetime budget: its name, budget, placement and the paths of its data
    on its node (for the fingerprint, which stays there)."""

    name: str
    budget: OwnerBudget
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

    @classmethod
    def start(cls, accounts: Sequence[OwnerAccount], planned: PrivacyCharge, run: str,
              records: Sequence[LedgerIdentity] = ()) -> OwnerLedgers:
        """Open every owner's ledger for ``run``, refusing (``LedgerMissing``) any that is
        missing, replaced or shorter than a record kept by the driver (``records``) or by
        another owner's node says; a new ledger's filter is fixed from ``planned``."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = {a.name: owner_node(a) for a in accounts}
        handles = {a.name: OwnerLedgerActor.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[a.name], soft=False)).remote(
            a.name, a.budget, a.data_paths) for a in accounts}
        ledgers = cls(handles, nodes)
        try:
            names = list(handles)
            paths = dict(zip(names, ray.get([handles[n].ledger_file.remote() for n in names])))
            found = dict(zip(names, ray.get([handles[n].identity.remote() for n in names])))
            kept = [("the driver", r) for r in records]
            for name, peers in zip(names, ray.get([handles[n].peer_records.remote() for n in names])):
                kept += [(f"{name}'s node", r) for r in peers]
            for name in names:
                check_not_missing(name, paths[name], found[name], kept)
            ray.get([handles[n].open.remote(planned, run) for n in names])
            ledgers.note_peers()
        except BaseException:
            ledgers.close()
            raise
        return ledgers

    @property
    def names(self) -> list[str]:
        return list(self._handles)

    def identities(self) -> list[LedgerIdentity]:
        return [i for i in ray.get([h.identity.remote() for h in self._handles.values()]) if i is not None]

    def note_peers(self) -> None:
        """Every owner's node keeps what it saw of the others' ledgers."""
        seen = self.identities()
        ray.get([h.note_peers.remote(seen) for h in self._handles.values()])

    def refusal(self, charge: PrivacyCharge) -> str | None:
        """The first owner's refusal of ``charge``, in one line, or None when all would accept it."""
        refusals = ray.get([h.refusal.remote(charge) for h in self._handles.values()])
        return next((r for r in refusals if r is not None), None)

    def charge(self, charge: PrivacyCharge, worst_case: PrivacyCharge | None = None) -> None:
        """Charge every owner at once. One refusal raises ``BudgetExceeded`` (its message names
        the owner); owners that accepted keep the charge — more than was released, never less."""
        refusals = ray.get([h.charge.remote(charge, worst_case) for h in self._handles.values()])
        refused = [r for r in refusals if r is not None]
        if refused:
            raise BudgetExceeded(refused[0])

    def reports(self) -> dict[str, BudgetReport]:
        names = list(self._handles)
        return dict(zip(names, ray.get([self._handles[n].report.remote() for n in names])))

    def close(self) -> None:
        """Keep the peers' records, close every ledger and stop the actors."""
        if self._handles:
            try:
                self.note_peers()
            except ray.exceptions.RayError as err:  # an owner's actor died: its own ledger is on its disk
                log.warning("owners' records of each other's ledgers not updated: %s", type(err).__name__)
        try:
            ray.get([h.close.remote() for h in self._handles.values()])
        except ray.exceptions.RayError as err:  # committed charges are on disk already (fsynced)
            log.warning("an owner's ledger did not close cleanly: %s", type(err).__name__)
        for handle in self._handles.values():
            ray.kill(handle)
        self._handles = {}
