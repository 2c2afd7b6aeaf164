"""A teacher/student ensemble served to outside students: ``conclave serve``'s start, step by step.

``TeacherStudent.service`` returns a ``Service``; each method is one step of the start (the
server's settings, the driver's public data, the port, the durable ledger, the teachers behind
the owners' admission, the server), so the command can check each before the next, undo what
has run and tell a failure in one line. Nothing here imports torch or Ray until a step needs them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conclave.cluster.owners import PublicData
from conclave.cluster.teaching.aggregation import (
    Aggregator, aggregator_ledger, check_port_free, serve, server_fields, server_settings,
)
from conclave.cluster.teaching.config import TeacherStudentConfig
from conclave.cluster.teaching.ensemble import Ensemble, checked_public, resolved, train_ensemble
from conclave.privacy.accounting.ledger import PrivacyLedger

if TYPE_CHECKING:
    from conclave.actors.aggregator import ServerSettings


@dataclass(frozen=True)
class Service:
    """``config`` served with ``overrides`` of its server's fields (host, port, TLS files,
    allow_plaintext; None: the config's)."""

    config: TeacherStudentConfig
    overrides: Mapping[str, Any]

    def fields(self) -> dict[str, Any]:
        """The server's fields, read without importing the server (its TLS files can be checked
        before the heavy libraries load)."""
        return server_fields(self.config, **self.overrides)

    def settings(self, token: str) -> ServerSettings:
        """The server's settings (``ValueError`` names a bad field, e.g. plaintext on a public host)."""
        return server_settings(self.config, token, **self.overrides)

    def public_data(self) -> PublicData:
        """The driver's public data, loaded and checked before Ray starts (``ConfigError``)."""
        return checked_public(self.config)

    def check_port(self) -> None:
        """``PortTaken`` when another process listens on the server's fixed port."""
        fields = self.fields()
        check_port_free(fields["host"], fields["port"])

    def open_ledger(self, path: Path) -> PrivacyLedger:
        """The service's durable ledger at ``path``: what it holds is kept across restarts."""
        return aggregator_ledger(self.config, path, service=True)

    def train(self, public: PublicData, ray_address: str | None) -> Ensemble:
        """Every owner's teachers (or voting records), trained where its data is: with owners, each
        owner's gateway first admits the service and checks it can pay one round."""
        return train_ensemble(resolved(self.config, public), ray_address, public=public)

    def serve(self, teachers: Ensemble, ledger: PrivacyLedger, token: str) -> Aggregator:
        """The gRPC aggregator over ``teachers``, charging ``ledger`` and the owners' ledgers."""
        return serve(self.config, teachers, ledger, token, **self.overrides)

    def voters(self, teachers: Ensemble) -> str:
        """A few words of what votes, for the operator."""
        return self.config.vote_source.serving(teachers.pool)
