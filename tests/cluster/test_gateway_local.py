"""The owners' gateways a run starts on its own machine (``cluster.gateway.local``): real gateways in
this process on 127.0.0.1 (mutual TLS from the run's own CA), over the test's Ray, reached by the same
``GatewayVoteSource`` as remote ones. Where an owner wrote no policy its config's budget stands, and
its report says so; a written policy decides, and a budget asking more is refused in one line,
before anything is charged; an owner with neither, or without declared records, starts nothing."""
from __future__ import annotations

from pathlib import Path

import pytest

from conclave.cluster.gateway.client import ClusterVotes, GatewayVoteSource, OwnerGateway
from conclave.cluster.gateway.identity import Verifier
from conclave.cluster.gateway.local import LocalGateways
from conclave.cluster.owners import DataOwner
from conclave.learning.data.sources import DataSource
from conclave.privacy.accounting.ledger import PrivacyLedger, read_ledger
from conclave.privacy.accounting.owner_policy import OwnerBudget, OwnerPolicy, OwnerRefused, write_policy
from tests.conftest import PROJECT_ROOT

DATA = PROJECT_ROOT / "examples" / "hospitals" / "data"
OWNERS = ("hospital_a", "hospital_b", "hospital_c")


def owners(tmp_path: Path, **budgets: OwnerBudget) -> list[DataOwner]:
    """The three hospitals by their data, each budget's ledger in a folder of this test (or as ``budgets`` say)."""
    return [DataOwner(name, DataSource("csv", str(DATA / name / "records.csv"), label="diagnosis"), records=100,
                      budget=budgets.get(name, OwnerBudget(20.0, directory=str(tmp_path / name)))) for name in OWNERS]


def test_an_owner_without_a_budget_or_declared_records_starts_no_gateway(tmp_path):
    no_budget = DataOwner("hospital_a", DataSource("csv", str(DATA / "hospital_a" / "records.csv")), records=100)
    with pytest.raises(OwnerRefused, match="hospital_a: no policy on this machine and no budget in the config"):
        LocalGateways.start([no_budget])
    undeclared = DataOwner("hospital_a", DataSource("csv", "records.csv"), budget=OwnerBudget(20.0))
    with pytest.raises(OwnerRefused, match="hospital_a: declare its records"):
        LocalGateways.start([undeclared])


def test_local_gateways_vote_like_remote_ones_under_the_config_budget_or_the_owners_policy(ray_session, tmp_path):
    from conclave.cluster.owners import PublicData
    from conclave.privacy.mechanisms.public_clusters import SecurePublicClusterVotes
    from conclave.actors.labeller import SecureLabeller

    public = PublicData.read(DataSource("csv", str(DATA / "public" / "unlabeled.csv")),
                             DataSource("csv", str(DATA / "public" / "test.csv"), label="diagnosis"), None)
    pool = public.splits.public.x
    with LocalGateways.start(owners(tmp_path), cpus_per_actor=0.2) as local:
        folder = Path(local.gateways.ca).parents[1]
        assert folder.stat().st_mode & 0o077 == 0  # the run's CA key and the gateways' keys: the user's alone
        assert set(local.addresses) == set(OWNERS) and local.budget_sources == dict.fromkeys(OWNERS, "config")
        assert all(address.startswith("127.0.0.1:") for address in local.addresses.values())
        reached = local.reaching(owners(tmp_path))
        assert [(o.name, o.gateway, o.data, o.budget) for o in reached] == [
            (name, local.addresses[name], None, None) for name in OWNERS]
        from conclave.cluster.active_gateways import coordinator_tls

        tls = coordinator_tls(local.gateways)
        source = GatewayVoteSource([OwnerGateway(local.addresses[o], tls) for o in OWNERS], Verifier(tls.ca),
                                   "local-run", ClusterVotes(3, "standardised-pca", 5), "public-clusters", 6.0,
                                   public.classes, pool, max_batch=20, rounds=1, reading=public.reading,
                                   names=OWNERS)
        try:
            with PrivacyLedger(tmp_path / "view.sqlite", 1e-5, None) as view:
                outcome = SecureLabeller(source, SecurePublicClusterVotes(sigma=6.0, votes_per_record=3),
                                         view).label(pool[:20])
            assert (outcome.labels != -1).mean() > 0.5
            accounts = source.accounts(local.budget_sources)
        finally:
            source.shutdown()
    assert not folder.exists()  # the certificates go with the gateways
    for owner in OWNERS:  # each charged once, in the ledger its config's budget names
        assert read_ledger(tmp_path / owner / f"{owner}.sqlite").charges == 1
        account = accounts[owner].as_dict()
        assert account["spent"]["charges"] == 1 and account["spent"]["charges_before_run"] == 0
        assert account["guarantee"]["epsilon"] == 20.0 and account["budget_source"]["source"] == "config"

    # hospital_a writes its policy (ε 1): it decides, and a config asking ε 20 is refused before any charge
    write_policy(OwnerPolicy("hospital_a", 1.0, str(tmp_path / "node_a")))
    try:
        with LocalGateways.start(owners(tmp_path, hospital_a=OwnerBudget(20.0))[:1], cpus_per_actor=0.2) as local:
            assert local.budget_sources == {"hospital_a": "policy"}
            tls = coordinator_tls(local.gateways)
            with pytest.raises(OwnerRefused) as refused:
                GatewayVoteSource([OwnerGateway(local.addresses["hospital_a"], tls)], Verifier(tls.ca),
                                  "asks-too-much", ClusterVotes(3, "standardised-pca", 5), "public-clusters", 6.0,
                                  public.classes, pool, max_batch=20, rounds=1, reading=public.reading)
    finally:
        OwnerPolicy.file("hospital_a").unlink()
    assert str(refused.value) == ("owner hospital_a: the config asks for a lifetime budget of ε 20, more than the ε 1 "
                                  "its policy allows; a run may ask for less, never more")
    assert all(read_ledger(tmp_path / o / f"{o}.sqlite").charges == 1 for o in OWNERS)
    assert not (tmp_path / "node_a").exists()
