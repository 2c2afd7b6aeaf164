"""Owners named by their data, on this machine: the run starts one gateway per owner itself.

A config whose owners give their ``data`` (the one-machine form: its machine is the owners') runs
through exactly the coordinator code that reaches owners on other machines (``GatewayVoteSource``,
``GatewayDpsgd``, NearPrivate's releases): ``LocalGateways.start`` serves each owner's gateway in this
process, on 127.0.0.1 at an ephemeral port, with a certificate from a CA the run makes for itself in a
private temporary folder (``cluster.tls``; removed when the gateways stop). Their actors run on the
run's Ray, which must be started (the embedded one: one machine is one user's trust domain).
``reaching`` then names the owners by those gateways alone.

Each owner's policy on this machine (``conclave owner init``, in ``$CONCLAVE_HOME``) decides, as for
``conclave owner serve``. Where an owner wrote none, its section's ``budget`` is its lifetime budget:
whoever writes the config on the owners' machine chooses it, and the run's report says so. Beside a
policy, the section's budget may ask for less, never more, and may not move the ledger. An owner with
neither is refused in one line: a gateway never releases anything without a budget.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from conclave.cluster.owners import DataOwner, GatewaysConfig
from conclave.errors import InvalidValue
from conclave.privacy.accounting.owner_policy import OwnerPolicy, OwnerRefused

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
OwnerT = TypeVar("OwnerT", bound=DataOwner)
ConfigT = TypeVar("ConfigT")


@dataclass
class LocalGateways:
    """The owners' gateways a run started on this machine: each owner's ``address`` (host:port), the
    coordinator's certificates (``gateways``), and where each owner's budget comes from
    (``budget_sources``: "policy", written by the owner here, or the run's "config")."""

    addresses: dict[str, str]
    gateways: GatewaysConfig
    budget_sources: dict[str, str]
    _servers: list = field(default_factory=list, repr=False)
    _folder: Path | None = field(default=None, repr=False)

    @classmethod
    def start(cls, owners: Sequence[DataOwner], base: str | None = None, max_epochs: int = 100,
              cpus_per_actor: float | None = None) -> LocalGateways:
        """One gateway per owner of ``owners`` (named by their data; relative paths are ``base``'s,
        default the working directory), serving in this process (Ray must be running).
        ``max_epochs``: the most epochs a run may have a gateway's teachers train (the run's own, on
        its own machine); ``cpus_per_actor``: what each owner's actor reserves (default: half the
        cluster's CPUs shared among the owners' actors). ``OwnerRefused`` (one line) for an owner with
        neither a policy here nor a budget in the config, or that declares no records."""
        from conclave.cluster.gateway.declaration import Declaration, TlsFiles
        from conclave.cluster.gateway.server import start_gateway
        from conclave.cluster.tls import create_authority, issue

        base = base or os.getcwd()
        sources = {owner.name: budget_source(owner) for owner in owners}
        if cpus_per_actor is None:
            cpus_per_actor = _cpus_per_actor(owners)
        folder = Path(tempfile.mkdtemp(prefix="conclave-gateways-"))  # 0700: the keys stay the user's
        local = cls({}, GatewaysConfig("", "", ""), sources, _folder=folder)
        try:
            authority = create_authority(folder / "ca", "this run's own gateways", days=1)
            coordinator = issue(authority, folder / "coordinator", (), name="coordinator", days=1)
            local.gateways = GatewaysConfig(str(coordinator.certificate), str(coordinator.key), str(coordinator.ca))
            names = [owner.name for owner in owners]
            for owner in owners:
                certificate = issue(authority, folder / owner.name, (LOOPBACK,), name="gateway", days=1,
                                    common_name=owner.name)
                declaration = Declaration(
                    owner.name, owner.data.anchored(base), owner.records, f"{LOOPBACK}:0",
                    TlsFiles(str(certificate.certificate), str(certificate.key), str(certificate.ca)),
                    peers=tuple(other for other in names if other != owner.name), actors=owner.actors,
                    max_epochs=max(max_epochs, 1))
                server = start_gateway(declaration, cpus_per_actor, asked=owner.budget)
                local._servers.append(server)
                local.addresses[owner.name] = server.address
        except BaseException:
            local.stop()
            raise
        log.info("owners' gateways on this machine: %s", ", ".join(f"{o} at {a}" for o, a in local.addresses.items()))
        return local

    def reaching(self, owners: Sequence[OwnerT]) -> tuple[OwnerT, ...]:
        """``owners`` named by their gateways alone, as a config naming remote gateways names them
        (what a pipeline adds to an owner, such as its teachers, stays)."""
        return tuple(dataclasses.replace(owner, gateway=self.addresses[owner.name], data=None, actors=1, records=None,
                                         budget=None) for owner in owners)

    def reach(self, config: ConfigT) -> ConfigT:
        """``config`` (a pipeline's, with ``owners`` and ``gateways``) as a config naming remote gateways
        says it: its owners by these gateways alone, with the coordinator's certificates."""
        return dataclasses.replace(config, owners=self.reaching(config.owners), gateways=self.gateways)

    def stop(self) -> None:
        """Stop every gateway (calls in flight end first, then its run's actors and ledger), and remove
        the certificates."""
        servers, self._servers = self._servers, []
        for server in servers:
            try:
                server.stop()
            except Exception as err:  # noqa: BLE001 - the others stop all the same
                log.warning("owner %s's gateway did not stop cleanly: %s", server.declaration.name, err)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def __enter__(self) -> LocalGateways:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def budget_source(owner: DataOwner) -> str:
    """Where ``owner``'s budget comes from on this machine; refused without one, or without declared
    records (``conclave plan --propose`` refuses such a config alike: its proposal would not run)."""
    if owner.data is None:
        raise InvalidValue(f"owner {owner.name} is named by its gateway: it is not started here")
    if owner.records is None:
        raise OwnerRefused(f"owner {owner.name}: declare its records (a public upper bound): its gateway sizes its "
                           "share of every secure sum by them")
    if OwnerPolicy.load(owner.name) is not None:
        return "policy"
    if owner.budget is None:
        raise OwnerRefused(f"owner {owner.name}: no policy on this machine and no budget in the config: write one "
                           f"(`conclave owner init {owner.name} --epsilon E`) or give the owner a budget")
    return "config"


def _cpus_per_actor(owners: Sequence[DataOwner]) -> float:
    """Half the cluster's CPUs, shared among the owners' actors (the student and the coordinator have the rest)."""
    import ray

    from conclave.actors.placement import cpu_share

    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    return cpu_share(cpus / 2, sum(owner.actors for owner in owners))
