"""A gateway reads its owner's table as the run's public pool says (the pool's columns, in their
order, and the pool's fill values), sent in Admit: hospital_b's records with their columns
shuffled and an extra column vote exactly as the unshuffled ones, through real gateways over
mutual TLS on 127.0.0.1."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from conclave.cluster.gateway.client import ClusterVotes, CoordinatorTls, GatewayVoteSource, OwnerGateway
from conclave.cluster.gateway.declaration import Declaration, TlsFiles
from conclave.cluster.gateway.identity import Verifier
from conclave.cluster.gateway.server import start_gateway
from conclave.cluster.owners import PublicData
from conclave.cluster.tls import create_authority, issue
from conclave.learning.data.sources import DataSource
from conclave.privacy.accounting.owner_policy import OwnerPolicy, write_policy
from conclave.privacy.noise import NoisePolicy
from conclave.privacy.secure_votes import SkellamVotes, cluster_votes
from tests.cluster.test_table_columns import DATA, shuffled

SIGMA = 1e-3  # noise that rounds to nothing: the two owners' totals compare exactly
CLASSES = ("benign", "malignant")


@pytest.fixture
def owners(ray_session, tmp_path, monkeypatch):
    """Two gateways, each its own owner: hospital_b's records as written, and shuffled."""
    monkeypatch.setenv("CONCLAVE_HOME", str(tmp_path / "home"))
    authority = create_authority(tmp_path / "ca", "test consortium", days=1)
    coordinator = issue(authority, tmp_path / "coordinator", (), name="coordinator", days=1)
    records = pd.read_csv(DATA / "hospital_b" / "records.csv")
    tables = {"plain": records, "shuffled": shuffled(records)}
    servers = {}
    try:
        for owner, table in tables.items():
            folder = tmp_path / owner
            certificate = issue(authority, folder, ("127.0.0.1",), name=owner, days=1, common_name=owner)
            table.to_csv(folder / "records.csv", index=False)
            write_policy(OwnerPolicy(owner, 1e12, str(folder / "ledger")))
            declaration = Declaration(owner, DataSource("csv", str(folder / "records.csv"), label="diagnosis"),
                                      len(table), "127.0.0.1:0", TlsFiles(str(certificate.certificate),
                                                                          str(certificate.key), str(certificate.ca)))
            servers[owner] = start_gateway(declaration, cpus_per_actor=0.25)
        yield CoordinatorTls(coordinator.certificate, coordinator.key, coordinator.ca), servers
    finally:
        for server in servers.values():
            server.stop()


def test_an_owners_shuffled_columns_vote_as_unshuffled_through_its_gateway(owners):
    tls, servers = owners
    public = PublicData.read(DataSource("csv", str(DATA / "public" / "unlabeled.csv")),
                             DataSource("csv", str(DATA / "public" / "test.csv"), label="diagnosis"), CLASSES)
    pool = public.splits.public.x
    release = SkellamVotes(SIGMA, cluster_votes(3))
    totals = {}
    for owner, server in servers.items():
        source = GatewayVoteSource([OwnerGateway(server.address, tls)], Verifier(tls.ca), f"columns-{owner}",
                                   ClusterVotes(3, "standardised-pca", 5), "public-clusters", SIGMA, CLASSES, pool,
                                   max_batch=len(pool), rounds=1, reading=public.reading)
        try:
            totals[owner] = source.noised_votes(pool, release, NoisePolicy(), lambda: None)
        finally:
            source.shutdown()
    assert totals["plain"].sum() == 3 * 100  # every record voted, for 3 queries each
    np.testing.assert_array_equal(totals["shuffled"], totals["plain"])
