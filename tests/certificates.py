"""Certificates for the aggregator's TLS tests: a CA, a server certificate for 127.0.0.1, and
a client certificate for mutual TLS, made by ``cluster.tls`` (the same code that makes Ray's)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from conclave.cluster.tls import LOOPBACK_NAMES, create_authority, issue


@dataclass(frozen=True)
class Certificates:
    ca: Path  # what clients trust (and the server, for mutual TLS)
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certificates(directory: Path) -> Certificates:
    authority = create_authority(directory, "conclave test CA", days=1)
    server = issue(authority, directory, LOOPBACK_NAMES, name="server", days=1)
    client = issue(authority, directory, (), name="client", days=1)
    return Certificates(authority.certificate, server.certificate, server.key, client.certificate, client.key)
