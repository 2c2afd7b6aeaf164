"""Secure vote rounds through three owners' gateways (real gRPC over mutual TLS on 127.0.0.1, real
Ray, real ledgers): a coordinator's ``SecureLabeller`` labels public digits, and each owner's
ledger holds exactly the charge its gateway computed, one per round."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conclave.actors.labeller import SecureLabeller
from conclave.cluster.gateway.client import ClusterVotes, GatewayVoteSource, KnnVotes
from conclave.privacy.accounting.ledger import BudgetExceeded, PrivacyLedger, read_ledger
from conclave.privacy.accounting.owner_policy import OwnerPolicy
from conclave.privacy.accounting.sampled_skellam import sampled_skellam_vote_charge
from conclave.privacy.accounting.skellam import skellam_charge
from conclave.privacy.mechanisms.private_knn import SecurePrivateKnn
from conclave.privacy.mechanisms.public_clusters import SecurePublicClusterVotes
from tests.gateways import CLASSES, OWNERS, gateways_serving, make_consortium

SIGMA = 4.0


@pytest.fixture(scope="module")
def consortium(ray_session, tmp_path_factory):
    directory = tmp_path_factory.mktemp("consortium")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONCLAVE_HOME", str(directory / "home"))
        with gateways_serving(make_consortium(directory)) as running:
            yield running


def _ledger(owner: str):
    return read_ledger(OwnerPolicy.load(owner).budget().ledger_path(owner))


def test_three_gateways_label_public_digits_and_each_owner_pays_its_own_charge(consortium, tmp_path):
    before = {owner: consortium.charges(owner) for owner in OWNERS}
    gateways = [consortium.gateway(owner) for owner in OWNERS]
    source = GatewayVoteSource(gateways, consortium.verifier, "clusters-run", ClusterVotes(3, "flatten", 64),
                               "public-clusters", SIGMA, CLASSES, consortium.public, max_batch=64, rounds=4)
    try:
        assert source.owners == OWNERS and source.ready()
        assert all(0 < admitted.planned_epsilon <= 10.0 for admitted in source.admitted)
        mechanism = SecurePublicClusterVotes(sigma=SIGMA, votes_per_record=3)
        with PrivacyLedger(tmp_path / "coordinator.sqlite", 1e-5, None) as ledger:
            labeller = SecureLabeller(source, mechanism, ledger)
            outcome = labeller.label(consortium.queries)
            assert ledger.report().charges == 1  # the coordinator's view: one round
        answered = outcome.labels != -1
        accuracy = float((outcome.labels[answered] == consortium.truth[answered]).mean())
        assert answered.mean() > 0.8 and accuracy > 0.6, (answered.mean(), accuracy)  # chance: 0.1
    finally:
        source.shutdown()
    for owner in OWNERS:
        snapshot = _ledger(owner)
        assert snapshot.charges == before[owner] + 1
        expected = skellam_charge(3.0, math.sqrt(3.0), SIGMA**2, count=1, orders=snapshot.orders)
        charge = snapshot.by_label["public-clusters"]
        np.testing.assert_allclose(charge.rdp, expected.rdp, rtol=1e-12)
        assert consortium.gateway(owner).budget().charges == snapshot.charges


def test_knn_votes_through_the_gateways(consortium, tmp_path):
    before = {owner: consortium.charges(owner) for owner in OWNERS}
    gateways = [consortium.gateway(owner) for owner in OWNERS]
    rate, batch = 0.5, 12
    source = GatewayVoteSource(gateways, consortium.verifier, "knn-run", KnnVotes(30, rate, "flatten", 64),
                               "private-knn", SIGMA, CLASSES, consortium.public, max_batch=batch, rounds=1)
    try:
        mechanism = SecurePrivateKnn(sigma1=SIGMA, threshold=0.0, sigma2=SIGMA, sample_rate=rate)
        with PrivacyLedger(tmp_path / "coordinator.sqlite", 1e-5, None) as ledger:
            labeller = SecureLabeller(source, mechanism, ledger)
            outcome = labeller.label(consortium.queries[:batch])
            # the one admitted round is used: the next is refused as spent for good, not "retry later"
            with pytest.raises(BudgetExceeded, match=r"^privacy budget exhausted: labelling 12 new inputs: the "
                                                     r"owners admitted run 'knn-run' for 1 round\(s\) of at "
                                                     r"most 12 queries, all used: nothing was asked, released or "
                                                     r"charged$"):
                labeller.label(consortium.queries[batch : 2 * batch])
            assert ledger.report().charges == 1
        accuracy = float((outcome.labels == consortium.truth[:batch]).mean())
        assert accuracy > 0.5, accuracy
    finally:
        source.shutdown()
    for owner in OWNERS:
        snapshot = _ledger(owner)
        assert snapshot.charges == before[owner] + 1
        expected = sampled_skellam_vote_charge(rate, SIGMA**2, count=batch, orders=snapshot.orders)
        np.testing.assert_allclose(snapshot.by_label["private-knn"].rdp, expected.rdp, rtol=1e-12)
