"""Teachers behind the owners' gateways (real gRPC over mutual TLS on 127.0.0.1, real Ray, real
ledgers, tiny digits teachers): each gateway trains its owner's teachers at admission, a
coordinator's ``SecureLabeller`` labels public digits through secure GNMax rounds, and each owner's
ledger holds one charge per round, the one-vote Skellam charge restated for its records. Terms
outside the registry, the owner's file or its policy are refused in one line before anything
trains or ends, and nothing is charged."""
from __future__ import annotations

import contextlib
import dataclasses
import math

import grpc
import numpy as np
import pytest

from conclave.actors.labeller import SecureLabeller
from conclave.cluster.gateway.client import GatewayVoteSource, TeacherVotes, float_tensor
from conclave.learning.data.dataset import SHARD_LEMMA
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.ledger import PrivacyLedger, read_ledger
from conclave.privacy.accounting.owner_policy import OwnerPolicy
from conclave.privacy.accounting.skellam import skellam_charge
from conclave.privacy.mechanisms.confident_gnmax import SecureConfidentGNMax
from conclave.privacy.mechanisms.gnmax import SecureGNMax
from conclave.protos import owner_pb2
from tests.gateways import CLASSES, OWNERS, Consortium, gateways_serving, make_consortium

RUN, SIGMA, BATCH, ROUNDS = "teachers-run", 3.0, 30, 2
TEACHERS = TeacherVotes(12, "digits_cnn", epochs=10, batch_size=16, lr=1e-2, seed=3)  # four per owner
MAX_TEACHERS = 8
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def consortium(ray_session, tmp_path_factory):
    directory = tmp_path_factory.mktemp("teaching")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONCLAVE_HOME", str(directory / "home"))
        consortium = make_consortium(directory, epsilon=100.0, max_run_epsilon=50.0)
        consortium.declarations = {owner: dataclasses.replace(declaration, max_teachers=MAX_TEACHERS, max_epochs=20)
                                   for owner, declaration in consortium.declarations.items()}
        with gateways_serving(consortium) as running:
            yield running


@pytest.fixture(scope="module")
def labelled(consortium, tmp_path_factory):
    """The honest run: teachers trained at every gateway, the queries labelled in secure rounds."""
    before = {owner: consortium.charges(owner) for owner in OWNERS}
    source = GatewayVoteSource([consortium.gateway(owner) for owner in OWNERS], consortium.verifier, RUN, TEACHERS,
                               "gnmax", SIGMA, CLASSES, None, max_batch=BATCH, rounds=ROUNDS)
    try:
        path = tmp_path_factory.mktemp("coordinator") / "ledger.sqlite"
        with PrivacyLedger(path, 1e-5, None) as ledger:
            outcome = SecureLabeller(source, SecureGNMax(sigma=SIGMA), ledger).label(consortium.queries[:BATCH])
            coordinator_charges = ledger.report().charges
        yield source, outcome, before, coordinator_charges
    finally:
        source.shutdown()


def test_teachers_trained_at_the_gateways_label_public_digits(consortium, labelled):
    source, outcome, _, coordinator_charges = labelled
    assert source.owners == OWNERS and source.votes_per_query == 12
    assert [admitted.cell_bound for admitted in source.admitted] == [4, 4, 4]
    assert all(0 < admitted.planned_epsilon <= 50.0 for admitted in source.admitted)
    assert source.neighbouring == Neighbouring.ADD_REMOVE and source.neighbouring_lemma == SHARD_LEMMA
    assert not source.batch_coupled and coordinator_charges == 1  # the coordinator's view: one round
    accuracy = float((outcome.labels == consortium.truth[:BATCH]).mean())
    assert accuracy > 0.5, accuracy  # chance: 0.1


def test_each_owner_pays_one_skellam_charge_per_round(consortium, labelled):
    _, _, before, _ = labelled
    for owner in OWNERS:
        snapshot = read_ledger(OwnerPolicy.load(owner).budget().ledger_path(owner))
        assert snapshot.charges == before[owner] + 1
        assert snapshot.neighbouring == Neighbouring.ADD_REMOVE
        # One teacher's vote per query: Δ₁ = 2, Δ₂ = √2 for each of the round's queries.
        expected = skellam_charge(2.0, math.sqrt(2.0), SIGMA**2, count=BATCH, orders=snapshot.orders)
        np.testing.assert_allclose(snapshot.by_label["gnmax"].rdp, expected.rdp, rtol=1e-12)
        assert consortium.gateway(owner).budget().charges == snapshot.charges


def _request(run: str, mechanism: str = "gnmax", **terms) -> owner_pb2.AdmitRequest:
    teachers = owner_pb2.TeacherTerms(**{**{"model": "digits_cnn", "teachers": 4, "epochs": 2, "batch_size": 16,
                                            "lr": 1e-2}, **terms})
    return owner_pb2.AdmitRequest(run=run, mechanism=mechanism, sigma=SIGMA, max_batch=BATCH, rounds=1,
                                  classes=list(CLASSES), teachers=teachers)


@pytest.fixture
def stub(consortium):
    channel, stub = consortium.stub("hospital_a")
    with channel:
        yield stub


@contextlib.contextmanager
def refused(consortium: Consortium, stub, code: grpc.StatusCode, *words: str):
    """The Admit inside is refused with ``code`` in one line naming the problem; nothing is charged,
    and nothing trained or ended: the honest run is still the one admitted (its round 1, keyed
    already, is refused as such, not as a run it no longer holds)."""
    before = {owner: consortium.charges(owner) for owner in OWNERS}
    with pytest.raises(grpc.RpcError) as caught:
        yield
    error = caught.value
    assert error.code() == code, (error.code(), error.details())
    assert "\n" not in error.details() and all(word in error.details() for word in words), error.details()
    assert {owner: consortium.charges(owner) for owner in OWNERS} == before
    with pytest.raises(grpc.RpcError) as still:
        stub.Keys(owner_pb2.KeysRequest(run=RUN, round=1, batch=BATCH), timeout=30)
    assert still.value.code() == Code.FAILED_PRECONDITION and "keyed once" in still.value.details()


@pytest.mark.parametrize("terms, code, words", [
    ({"model": "os:system"}, Code.PERMISSION_DENIED, ("model 'os:system' is not registered", "no code")),
    ({"model": "conclave.learning.models.cnn:digits_cnn"}, Code.PERMISSION_DENIED, ("not registered",)),
    ({"model": "my_resnet"}, Code.PERMISSION_DENIED, ("not registered",)),
    ({"teachers": MAX_TEACHERS + 1}, Code.INVALID_ARGUMENT, ("teachers.teachers", f"[1, {MAX_TEACHERS}]")),
    ({"teachers": 0}, Code.INVALID_ARGUMENT, ("teachers.teachers",)),
    ({"epochs": 21}, Code.INVALID_ARGUMENT, ("teachers.epochs", "[1, 20]")),
    ({"lr": math.inf}, Code.INVALID_ARGUMENT, ("teachers.lr",)),
    ({"batch_size": 0}, Code.INVALID_ARGUMENT, ("teachers.batch_size",)),
    ({"seed": -1}, Code.INVALID_ARGUMENT, ("teachers.seed",)),
])
def test_teacher_terms_outside_the_registry_or_the_owners_file_are_refused(consortium, labelled, stub, terms, code,
                                                                          words):
    with refused(consortium, stub, code, *words):
        stub.Admit(_request(f"outside-{sorted(terms)[0]}", **terms), timeout=120)


@pytest.mark.parametrize("mechanism", ["public-clusters", "private-knn", "lnmax", "my.module:Mechanism"])
def test_a_mechanism_not_registered_for_teachers_is_refused(consortium, labelled, stub, mechanism):
    with refused(consortium, stub, Code.PERMISSION_DENIED, "mechanism", "not registered for teachers votes"):
        stub.Admit(_request(f"mechanism-{mechanism}", mechanism), timeout=120)


def test_a_public_pool_for_teachers_is_refused(consortium, labelled, stub):
    request = _request("pooled")
    request.public_pool.CopyFrom(float_tensor(consortium.public))
    with refused(consortium, stub, Code.INVALID_ARGUMENT, "public_pool", "teachers"):
        stub.Admit(request, timeout=120)


@contextlib.contextmanager
def policy_changed(owner: str, **changes):
    """``owner``'s policy file rewritten with ``changes`` for the block, as on the owner's machine
    (the gateway reads it again at each Admit)."""
    policy = OwnerPolicy.load(owner)
    dataclasses.replace(policy, **changes).save()
    try:
        yield
    finally:
        policy.save()


def test_a_mechanism_the_owners_policy_does_not_admit_is_refused(consortium, labelled, stub):
    with policy_changed("hospital_a", mechanisms=("gnmax",)):
        with refused(consortium, stub, Code.PERMISSION_DENIED, "admits the mechanisms gnmax", "confident-gnmax"):
            stub.Admit(_request("confident", "confident-gnmax"), timeout=120)


def test_a_policy_for_another_neighbouring_relation_refuses_teachers(consortium, labelled, stub):
    # A record replaced may move two teachers' votes: the shard lemma covers add/remove only.
    with policy_changed("hospital_a", neighbouring=Neighbouring.REPLACE_ONE):
        with refused(consortium, stub, Code.PERMISSION_DENIED, "replace-one", "add-remove"):
            stub.Admit(_request("replaced"), timeout=120)


def test_confident_gnmax_runs_its_two_rounds_at_the_admitted_sigma(consortium, labelled, tmp_path):
    # Last: admitting this run ends the one above at every gateway. One σ is admitted per run, so
    # the threshold round and the answering round both run at it; each owner pays for the rows of each.
    before = {owner: consortium.charges(owner) for owner in OWNERS}
    terms = dataclasses.replace(TEACHERS, teachers=(2, 3, 4))
    source = GatewayVoteSource([consortium.gateway(owner) for owner in OWNERS], consortium.verifier, "confident",
                               terms, "confident-gnmax", SIGMA, CLASSES, None, max_batch=BATCH, rounds=2)
    try:
        assert source.votes_per_query == 9
        mechanism = SecureConfidentGNMax(sigma1=SIGMA, threshold=6.0, sigma2=SIGMA)
        with PrivacyLedger(tmp_path / "coordinator.sqlite", 1e-5, None) as ledger:
            outcome = SecureLabeller(source, mechanism, ledger).label(consortium.queries[:BATCH])
    finally:
        source.shutdown()
    rounds = 2 if outcome.answered else 1
    for owner in OWNERS:
        snapshot = read_ledger(OwnerPolicy.load(owner).budget().ledger_path(owner))
        assert snapshot.charges == before[owner] + rounds
        expected = skellam_charge(2.0, math.sqrt(2.0), SIGMA**2, count=BATCH + outcome.answered,
                                  orders=snapshot.orders)
        np.testing.assert_allclose(snapshot.by_label["confident-gnmax"].rdp, expected.rdp, rtol=1e-12)
