"""NearPrivate's two releases through the owners' gateways (real gRPC over mutual TLS on 127.0.0.1, real
ledgers, the tiny registered digits model): admitted with a DP-SGD run, after its steps each gateway
answers the DP-PCA covariance and the support counts under the checkpoint's weights with one masked
share, charged in its owner's ledger first. The decoded counts are the clean counts of all owners'
records plus the secure sum's Skellam noise; a replayed release, a round the run was not admitted for,
a key with other terms and points of another number are each refused in one line, nothing charged."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conclave.cluster.gateway.client import float_tensor
from conclave.cluster.gateway.dpsgd_client import DpsgdTerms, GatewayDpsgd
from conclave.cluster.gateway.near_private import NearPrivateReleases
from conclave.learning.embedding_stats import support_counts
from conclave.learning.models import build_model
from conclave.learning.selection.entropy import logit_entropy
from conclave.learning.training import embed, predict_logits
from conclave.privacy.accounting.ledger import PrivacyLedger, read_ledger
from conclave.privacy.accounting.owner_policy import OwnerPolicy
from conclave.privacy.counts import SkellamCounts
from conclave.privacy.pca import SecureAnalyzeGauss, normalise_rows
from conclave.protos import owner_pb2
from tests.cluster.test_gateway_dpsgd import Code, _weights, refused
from tests.gateways import CLASSES, OWNERS, gateways_serving, make_consortium

STEPS, COMPONENTS, POINTS = 3, 8, 40
RELEASES = NearPrivateReleases(SecureAnalyzeGauss(0.5, 1e-5), SkellamCounts(0.5, 1e-5))


def _terms(steps: int = STEPS, near_private: NearPrivateReleases | None = RELEASES) -> DpsgdTerms:
    return DpsgdTerms("digits_cnn", max_grad_norm=1.0, noise_multiplier=1.0, sample_rate=0.1, steps=steps,
                      near_private=near_private)


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    directory = tmp_path_factory.mktemp("near-private")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONCLAVE_HOME", str(directory / "home"))
        with gateways_serving(make_consortium(directory, epsilon=100.0, max_run_epsilon=20.0)) as running:
            yield running


@pytest.fixture(scope="module")
def released(consortium, tmp_path_factory):
    """The honest run: its steps, then NearPrivate's projection and counts under the trained weights."""
    before = {owner: consortium.charges(owner) for owner in OWNERS}
    model = build_model("digits_cnn", len(CLASSES), input_shape=(1, 8, 8), seed=0)
    with PrivacyLedger(tmp_path_factory.mktemp("coordinator") / "ledger.sqlite", 1e-5, None) as ledger:
        run = GatewayDpsgd([consortium.gateway(owner) for owner in OWNERS], consortium.verifier, "np-run", _terms(),
                           CLASSES, ledger=ledger)
        try:
            run.train(model, torch.optim.SGD(model.parameters(), lr=2.0))
            model.eval()
            dimension = embed(model, consortium.public[:1]).shape[1]
            support = run.support([p.detach().numpy() for p in model.parameters()], dimension, ledger)
            projection = support.dp_projection(COMPONENTS)
            points = normalise_rows(embed(model, consortium.public[:POINTS])) @ projection
            threshold = float(np.median(logit_entropy(predict_logits(model, consortium.public[:POINTS]))))
            noisy = support.noisy_support(projection, points.astype(np.float32), threshold)
            yield {"run": run, "model": model, "projection": projection, "points": points, "threshold": threshold,
                   "noisy": noisy, "before": before, "coordinator": ledger.report()}
        finally:
            run.shutdown()


def test_the_projection_and_the_counts_come_from_the_owners_records(consortium, released):
    projection, model = released["projection"], released["model"]
    assert projection.shape[1] == COMPONENTS
    np.testing.assert_allclose(projection.T @ projection, np.eye(COMPONENTS), atol=1e-8)
    records = np.concatenate([np.load(consortium.declarations[owner].data.path)["x"] for owner in OWNERS])
    clean = support_counts(embed(model, records, batch_size=1),
                           logit_entropy(predict_logits(model, records, batch_size=1)),
                           projection.astype(np.float32).astype(np.float64),
                           released["points"].astype(np.float32).astype(np.float64), released["threshold"])
    noisy = released["noisy"]
    assert noisy.shape == (POINTS,) and clean.sum() > 100
    # the total's Skellam noise has std z against any one owner: six of them bound every count's error
    assert np.abs(noisy - clean).max() < 6 * RELEASES.counts.noise_multiplier, (noisy, clean)


def test_each_owner_pays_each_release_once_beside_its_steps(consortium, released):
    assert released["coordinator"].charges == STEPS + 2
    for owner in OWNERS:
        snapshot = read_ledger(OwnerPolicy.load(owner).budget().ledger_path(owner))
        assert snapshot.charges == released["before"][owner] + STEPS + 2
        for label, release in (("dp-pca", RELEASES.pca), ("noisy-counts", RELEASES.counts)):
            np.testing.assert_allclose(snapshot.by_label[label].rdp, release.charge().rdp, rtol=1e-9)
        assert released["run"].accounts()[owner].charges == snapshot.charges


@pytest.fixture
def stub(consortium):
    channel, stub = consortium.stub("hospital_a")
    with channel:
        yield stub


def test_a_release_is_answered_once(consortium, released, stub):
    weights = [float_tensor(p.detach().numpy()) for p in released["model"].parameters()]
    with refused(consortium, Code.FAILED_PRECONDITION, f"round {STEPS + 1}", "a key serves one release"):
        stub.NearPrivate(owner_pb2.NearPrivateRequest(run="np-run", round=STEPS + 1, weights=weights), timeout=30)
    with refused(consortium, Code.PERMISSION_DENIED, f"admitted for {STEPS} steps and NearPrivate",
                 f"round {STEPS + 3}"):
        stub.Keys(owner_pb2.KeysRequest(run="np-run", round=STEPS + 3, batch=1), timeout=30)


def _admitted(consortium, run: str, terms: DpsgdTerms) -> list:
    """``run`` admitted at every gateway (its keys asked by the test itself)."""
    gateways = [consortium.gateway(owner) for owner in OWNERS]
    admitting = GatewayDpsgd(gateways, consortium.verifier, run, terms, CLASSES)
    admitting.shutdown()
    return [consortium.stub(owner) for owner in OWNERS]


def test_keys_of_other_terms_or_points_of_another_number_are_refused(consortium, released):
    """After the honest run (it ends it): one owner's key with a lower multiplier, and counts for fewer
    points than keyed, are refused before any charge."""
    channels = _admitted(consortium, "np-tamper", _terms(steps=1))
    shapes = [tuple(p.shape) for p in released["model"].parameters()]
    try:
        keys = [stub.Keys(owner_pb2.KeysRequest(run="np-tamper", round=2, batch=1), timeout=30) for _, stub in channels]
        tampered = owner_pb2.SignedKey()
        tampered.CopyFrom(keys[1])
        tampered.sigma = keys[1].sigma / 10
        _, stub_a = channels[0]
        with refused(consortium, Code.PERMISSION_DENIED, "hospital_b", "not signed by that owner"):
            stub_a.NearPrivate(owner_pb2.NearPrivateRequest(run="np-tamper", round=2, parties=[keys[0], tampered, keys[2]],
                                                            weights=_weights(shapes)), timeout=30)
        keys = [stub.Keys(owner_pb2.KeysRequest(run="np-tamper", round=3, batch=5), timeout=30) for _, stub in channels]
        d = released["projection"].shape[0]  # the embeddings' width
        projection = float_tensor(np.eye(d, 2, dtype=np.float32))
        with refused(consortium, Code.INVALID_ARGUMENT, "public_points", "keyed for 5"):
            stub_a.NearPrivate(owner_pb2.NearPrivateRequest(
                run="np-tamper", round=3, parties=keys, weights=_weights(shapes), projection=projection,
                public_points=float_tensor(np.zeros((4, 2), dtype=np.float32))), timeout=30)
    finally:
        for channel, _ in channels:
            channel.close()


def test_a_run_admitted_without_near_private_answers_no_release(consortium, released):
    channels = _admitted(consortium, "np-none", _terms(steps=2, near_private=None))
    _, stub = channels[0]
    try:
        with refused(consortium, Code.PERMISSION_DENIED, "admitted for 2 steps", "not round 3"):
            stub.Keys(owner_pb2.KeysRequest(run="np-none", round=3, batch=1), timeout=30)
        with refused(consortium, Code.PERMISSION_DENIED, "not one of NearPrivate's releases"):
            stub.NearPrivate(owner_pb2.NearPrivateRequest(run="np-none", round=3), timeout=30)
    finally:
        for channel, _ in channels:
            channel.close()


def test_near_private_terms_outside_the_protocol_are_refused(consortium, released, stub):
    request = owner_pb2.AdmitRequest(run="np-bad", mechanism="dpsgd", classes=list(CLASSES), dpsgd=owner_pb2.DpsgdTerms(
        model="digits_cnn", max_grad_norm=1.0, noise_multiplier=1.0, sample_rate=0.1, steps=2, parties=list(OWNERS),
        records=1200, near_private=owner_pb2.NearPrivateTerms(pca_epsilon=0.5, support_epsilon=-1.0, delta=1e-5)))
    with refused(consortium, Code.INVALID_ARGUMENT, "near_private.support_epsilon"):
        stub.Admit(request, timeout=60)
