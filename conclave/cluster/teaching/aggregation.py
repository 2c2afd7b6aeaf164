"""The private aggregator over an ensemble: gRPC on a real port, every answer charged to the
run's ledger first, and the privacy report the run may publish."""
from __future__ import annotations

import dataclasses
import logging
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from conclave.errors import RunRefused
from conclave.cluster.run_privacy import SECURE_VOTES, GatewayAccount, RunPrivacy
from conclave.cluster.teaching.config import TeacherStudentConfig
from conclave.cluster.teaching.ensemble import Ensemble, resolved
from conclave.learning.data.dataset import SHARD_LEMMA
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.ledger import AnsweringLedger, PrivacyLedger

log = logging.getLogger(__name__)

SECURE_NO_ESTIMATES = ("no data-dependent estimate: they are computed from the clean votes, which aggregation: secure "
                       "never shows anyone; the guarantee is the data-independent one")


class PortTaken(RunRefused, OSError):
    """The aggregator's fixed port is taken: found before any teacher trains."""


def check_port_free(host: str, port: int) -> None:
    """``PortTaken`` (one line) when another process listens on ``host:port``: checked before the
    teachers train, as the gRPC server would refuse the port only after (0: any free port)."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT is no holder
        try:
            probe.bind((host, port))
        except OSError:
            raise PortTaken(f"could not bind the aggregator to {host}:{port}: the address is in use or not on this "
                            "host") from None


def server_fields(config: TeacherStudentConfig, **overrides: Any) -> dict[str, Any]:
    """``config.server``'s fields, with ``overrides`` that are not None in their place (no import
    of the server: a command checks its TLS files with these before the heavy libraries load)."""
    return {**dataclasses.asdict(config.server), **{k: v for k, v in overrides.items() if v is not None}}


def server_settings(config: TeacherStudentConfig, token: str, **overrides: Any):
    """The aggregator's ``ServerSettings`` from ``server_fields`` (``ValueError`` names a bad
    field, e.g. plaintext on a public host)."""
    from conclave.actors.aggregator import ServerSettings

    return ServerSettings(token=token, **server_fields(config, **overrides))


def start_aggregator(config: TeacherStudentConfig, pool, ledger, settings):
    """The gRPC aggregator over ``pool`` in this process; returns (server, "host:port")."""
    from conclave.actors.aggregator import AggregatorServer

    server = AggregatorServer(pool, config.answering_mechanism(), ledger, pool.input_shape, settings,
                              noise=config.privacy.noise)
    return server, server.start()


def privacy_section(config: TeacherStudentConfig, ledger, votes: np.ndarray | None,
                    answered: np.ndarray | None) -> RunPrivacy:
    """What a run may publish about its privacy (``privacy.json``).

    The guarantee and what was spent (``PrivacyConfig.report``), the mechanism, and the
    report of the votes it answered: only its public estimates, i.e. those not computed from
    the private votes without a mechanism — the smooth-sensitivity release (whose cost
    ``reserve_estimates`` charged before the first query) or NZC's claim. With
    ``aggregation: secure`` there are no votes (None): nobody saw them, so no estimate exists.
    """
    from conclave.privacy.accounting.report import vote_report

    planned = config.planned()
    trust = SECURE_VOTES if config.secure else config.vote_source.trust
    report = config.privacy.report(planned, ledger, trust)
    report = report.adding(mechanism=config.vote_mechanism.describe().as_dict())
    if config.secure:
        return report.adding(estimates_note=SECURE_NO_ESTIMATES)
    if not len(votes):
        return report
    votes_report = vote_report(config.mechanism.instance, votes, answered, config.privacy.delta,
                               config.privacy.guarantee(planned), smooth=config.smooth_sensitivity(),
                               noise=config.privacy.noise.source("smooth-sensitivity"))
    return report.adding(tuple(e for e in votes_report.estimates if not e.private),
                         queries=votes_report.queries, answered=votes_report.answered)


def reserve_estimates(config: TeacherStudentConfig, ledger) -> None:
    """Charge the smooth-sensitivity release before the first query: its cost is fixed by
    public parameters, and paying first keeps a student that spends the budget from leaving
    no room for it."""
    smooth = config.smooth_sensitivity()
    if smooth is not None:
        ledger.charge(smooth.charge(ledger.orders).for_records(Neighbouring.ADD_REMOVE, SHARD_LEMMA))


@dataclass
class Aggregator:
    """A running gRPC aggregator over an ensemble, and the ledger every answer is charged to;
    ``owner_accounts``: the owners' lifetime accounts as their gateways report them (none without owners)."""

    config: TeacherStudentConfig
    server: Any  # actors.aggregator.AggregatorServer
    ledger: AnsweringLedger  # the run's or service's (owners charge their own, behind their gateways)
    address: str  # host:port
    token: str  # the bearer token clients send
    owner_accounts: Callable[[], Mapping[str, GatewayAccount]] = dict
    _running: bool = field(default=True, repr=False)

    def budget(self):
        """The budget reply clients get (``actors.labeller.BudgetStatus``)."""
        return self.server.budget()

    def privacy_report(self) -> RunPrivacy:
        """What the run may publish: the guarantee, the spend, labelled estimates, and the owners' lifetime
        accounts as their gateways report them now."""
        if self.config.secure:  # the aggregator never saw a clean vote: nothing to estimate from
            report = privacy_section(self.config, self.ledger, None, None)
        else:
            votes, answered = self.server.answered_votes()
            report = privacy_section(self.config, self.ledger, votes, answered)
        return report.with_owner_accounts(self.owner_accounts())

    def stop(self) -> None:
        """Stop serving (the ledger stays open for ``privacy_report``)."""
        if self._running:
            self.server.stop()
            self._running = False

    def close(self) -> None:
        self.stop()
        self.ledger.close()

    def __enter__(self) -> Aggregator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def aggregator_ledger(config: TeacherStudentConfig, path: str | Path, service: bool = False) -> PrivacyLedger:
    """The ledger an aggregator charges, its budget fixed now from the planned work, before any
    data is read. A run's starts empty (what an earlier run left at ``path`` is removed); a
    ``service``'s keeps what it holds across restarts and is durable (``PrivacyConfig.open_ledger``)."""
    path = Path(path)
    if not service:
        for stale in path.parent.glob(path.name + "*"):
            stale.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    return config.privacy.open_ledger(path, config.planned(), durable=service)


def serve(config: TeacherStudentConfig, ensemble: Ensemble, ledger: str | Path | PrivacyLedger,
          token: str | None = None, **server: Any) -> Aggregator:
    """Serve ``ensemble`` with ``config``'s mechanism, every answer charged first to ``ledger`` —
    a path (a run's ledger, started empty: ``aggregator_ledger``) or a ledger already open (a
    service's, opened before its teachers trained); owners' gateways charge their owners' ledgers
    themselves, each round before their shares leave. ``server``: ``ServerSettings`` fields to
    override (host, port, TLS...). The ``Aggregator`` closes the ledger; so does a failure to start."""
    config = resolved(config, ensemble.public)
    if not isinstance(ledger, PrivacyLedger):
        ledger = aggregator_ledger(config, ledger)
    token = token or secrets.token_urlsafe(24)
    try:
        reserve_estimates(config, ledger)
        aggregator, address = start_aggregator(config, ensemble.pool, ledger, server_settings(config, token, **server))
    except BaseException:
        ledger.close()
        raise
    log.info("aggregator serving on %s", address)
    return Aggregator(config, aggregator, ledger, address, token, ensemble.owner_accounts)
