"""A consortium for the gateway tests: a CA, one certificate per owner (common name = the owner, for
127.0.0.1) and one for the coordinator, each owner's digits in its own npz file, its policy, and its
declaration; gateways started in this process over the test's Ray, on ephemeral ports."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from conclave.cluster.gateway.client import CoordinatorTls, OwnerGateway
from conclave.cluster.gateway.declaration import Declaration, TlsFiles
from conclave.cluster.gateway.identity import Verifier
from conclave.cluster.gateway.server import GatewayServer, start_gateway
from conclave.cluster.tls import create_authority, issue
from conclave.learning.data import load_digits
from conclave.learning.data.sources import DataSource
from conclave.privacy.accounting.ledger import read_ledger
from conclave.privacy.accounting.owner_policy import OwnerPolicy, write_policy
from conclave.protos import owner_pb2_grpc

CLASSES = tuple(str(c) for c in range(10))
OWNERS = ("hospital_a", "hospital_b", "hospital_c")
RECORDS = 400


@dataclass
class Consortium:
    directory: Path
    coordinator: CoordinatorTls
    declarations: dict[str, Declaration]
    public: np.ndarray  # public digits the embedding is fitted on
    queries: np.ndarray  # public digits to label, and their true classes
    truth: np.ndarray
    servers: dict[str, GatewayServer] = field(default_factory=dict)

    @property
    def verifier(self) -> Verifier:
        return Verifier(self.coordinator.ca)

    def gateway(self, owner: str) -> OwnerGateway:
        return OwnerGateway(self.servers[owner].address, self.coordinator)

    def stub(self, owner: str) -> tuple[grpc.Channel, owner_pb2_grpc.OwnerStub]:
        channel = channel_to(self.servers[owner].address, self.coordinator)
        return channel, owner_pb2_grpc.OwnerStub(channel)

    def charges(self, owner: str) -> int:
        path = OwnerPolicy.load(owner).budget().ledger_path(owner)
        return read_ledger(path).charges if path.exists() else 0


def channel_to(address: str, tls: CoordinatorTls) -> grpc.Channel:
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(
        root_certificates=tls.ca.read_bytes(), private_key=tls.key.read_bytes(),
        certificate_chain=tls.certificate.read_bytes()))


def make_consortium(directory: Path, epsilon: float = 30.0, max_run_epsilon: float = 10.0) -> Consortium:
    """Certificates, data, policies (in ``$CONCLAVE_HOME``, set by the caller) and declarations."""
    authority = create_authority(directory / "ca", "consortium test CA", days=1)
    coordinator = issue(authority, directory / "coordinator", (), name="coordinator", days=1)
    train, test = load_digits()
    declarations = {}
    for index, owner in enumerate(OWNERS):
        certificate = issue(authority, directory / owner, ("127.0.0.1",), name=owner, days=1, common_name=owner)
        rows = slice(index * RECORDS, (index + 1) * RECORDS)
        data = directory / owner / "records.npz"
        np.savez(data, x=train.x[rows], y=train.y[rows].astype(str))
        write_policy(OwnerPolicy(owner, epsilon, str(directory / owner / "ledger"), max_run_epsilon=max_run_epsilon,
                                 data=(str(data),)))
        declarations[owner] = Declaration(
            owner, DataSource("npz", str(data), label="y"), RECORDS, "127.0.0.1:0",
            TlsFiles(str(certificate.certificate), str(certificate.key), str(certificate.ca)),
            peers=tuple(o for o in OWNERS if o != owner))
    return Consortium(directory, CoordinatorTls(coordinator.certificate, coordinator.key, coordinator.ca),
                      declarations, train.x[3 * RECORDS:], test.x[:60], test.y[:60])


@contextlib.contextmanager
def gateways_serving(consortium: Consortium):
    """Every owner's gateway in this process (Ray must be running), stopped afterwards."""
    try:
        for owner, declaration in consortium.declarations.items():
            consortium.servers[owner] = start_gateway(declaration, cpus_per_actor=0.25)
        yield consortium
    finally:
        for server in consortium.servers.values():
            server.stop()
        consortium.servers.clear()
