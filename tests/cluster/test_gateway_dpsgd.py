"""DP-SGD through the owners' gateways (real gRPC over mutual TLS on 127.0.0.1, real ledgers, the
registered digits model at width 8): each step is a secure sum of the owners' masked shares of their
noised clipped gradient sums, and the coordinator's model learns from the decoded total. Each owner's ledger
holds one charge per step, the subsampled Skellam at the admitted q and z; terms outside the registry
or the policy, weights of another shape, a replayed step and a step past the admitted ones are each
refused in one line, with nothing charged."""
from __future__ import annotations

import contextlib

import grpc
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conclave.cluster.gateway.client import float_tensor
from conclave.cluster.gateway.dpsgd_client import DpsgdTerms, GatewayDpsgd
from conclave.learning.data import load_digits
from conclave.learning.models import build_model
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.ledger import PrivacyLedger, read_ledger
from conclave.privacy.accounting.owner_policy import OwnerPolicy
from conclave.privacy.accounting.skellam import subsampled_skellam_charge
from conclave.protos import owner_pb2
from tests.gateways import CLASSES, OWNERS, Consortium, gateways_serving, make_consortium

RUN, Z, Q, ADMITTED, TRAINED, WIDTH = "dpsgd-run", 0.8, 0.1, 32, 30, 8
TERMS = DpsgdTerms("digits_cnn", max_grad_norm=1.0, noise_multiplier=Z, sample_rate=Q, steps=ADMITTED, seed=0,
                   arguments=(("width", WIDTH),))
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dpsgd")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONCLAVE_HOME", str(directory / "home"))
        with gateways_serving(make_consortium(directory, epsilon=100.0, max_run_epsilon=15.0)) as running:
            yield running


def _test_loss(model: torch.nn.Module) -> tuple[float, float]:
    _, test = load_digits()
    with torch.no_grad():
        logits = model(torch.from_numpy(test.x))
    truth = torch.from_numpy(test.y)
    return float(F.cross_entropy(logits, truth)), float((logits.argmax(1) == truth).float().mean())


@pytest.fixture(scope="module")
def trained(consortium, tmp_path_factory):
    """The honest run: TRAINED of the ADMITTED steps through the three gateways."""
    before = {owner: consortium.charges(owner) for owner in OWNERS}
    model = build_model("digits_cnn", len(CLASSES), input_shape=(1, 8, 8), seed=0, width=WIDTH)
    initial = _test_loss(model)
    path = tmp_path_factory.mktemp("coordinator") / "ledger.sqlite"
    with PrivacyLedger(path, 1e-5, None) as ledger:
        run = GatewayDpsgd([consortium.gateway(owner) for owner in OWNERS], consortium.verifier, RUN, TERMS, CLASSES,
                           ledger=ledger)
        try:
            run.train(model, torch.optim.SGD(model.parameters(), lr=1.0), steps=TRAINED)
            coordinator_charges = ledger.report().charges
            yield run, model, initial, before, coordinator_charges
        finally:
            run.shutdown()


def test_steps_through_the_gateways_train_the_model(trained):
    run, model, (initial_loss, _), _, coordinator_charges = trained
    assert run.owners == OWNERS and run.records == 3 * 400
    assert [a.cell_bound for a in run.admitted] == [400] * 3
    assert all(0 < a.planned_epsilon <= 15.0 for a in run.admitted)
    assert coordinator_charges == TRAINED
    loss, accuracy = _test_loss(model)
    # 30 noised steps (z 0.8 at q 0.1: each coordinate's noise z·21, the quantized sum's Δ, over a batch of
    # ~120) of a fresh 9,802-parameter CNN at lr 1 (at lr 2 the noise's own effect on the loss dominates).
    # In 30 runs the loss fell 0.80 ± 0.10 (0.52–0.98) and the accuracy reached 0.60 ± 0.07 (0.46–0.72):
    # each bar is about five standard deviations below its mean
    assert loss < initial_loss - 0.3 and accuracy > 0.25, (initial_loss, loss, accuracy)


def test_each_owner_pays_one_subsampled_skellam_charge_per_step(consortium, trained):
    run, _, _, before, _ = trained
    for owner in OWNERS:
        snapshot = read_ledger(OwnerPolicy.load(owner).budget().ledger_path(owner))
        assert snapshot.charges == before[owner] + TRAINED
        assert snapshot.neighbouring == Neighbouring.ADD_REMOVE
        # The dominating Δ₁ = Δ₂ = 1 + 1/0.05 = 21 of every plan, at μ = (z·21)², q, one step each.
        one = subsampled_skellam_charge(Q, 21.0, 21.0, (Z * 21.0) ** 2, 1, orders=snapshot.orders)
        np.testing.assert_allclose(snapshot.by_label["dpsgd"].rdp, TRAINED * one.rdp, rtol=1e-9)
        account = run.accounts()[owner]  # as its gateway reports it
        assert account.charges == snapshot.charges and account.charges_before_run == before[owner]


@pytest.fixture
def stub(consortium):
    channel, stub = consortium.stub("hospital_a")
    with channel:
        yield stub


@contextlib.contextmanager
def refused(consortium: Consortium, code: grpc.StatusCode, *words: str):
    """The call inside is refused with ``code`` in one line naming the problem; nothing is charged."""
    before = {owner: consortium.charges(owner) for owner in OWNERS}
    with pytest.raises(grpc.RpcError) as caught:
        yield
    error = caught.value
    assert error.code() == code, (error.code(), error.details())
    assert "\n" not in error.details() and all(word in error.details() for word in words), error.details()
    assert {owner: consortium.charges(owner) for owner in OWNERS} == before


def _admit(run: str, **terms) -> owner_pb2.AdmitRequest:
    dpsgd = {"model": "digits_cnn", "max_grad_norm": 1.0, "noise_multiplier": Z, "sample_rate": Q, "steps": 2,
             "parties": list(OWNERS), "records": 1200, **terms}
    return owner_pb2.AdmitRequest(run=run, mechanism="dpsgd", classes=list(CLASSES),
                                  dpsgd=owner_pb2.DpsgdTerms(**dpsgd))


def _weights(shapes) -> list[owner_pb2.Tensor]:
    return [float_tensor(np.zeros(shape, dtype=np.float32)) for shape in shapes]


def test_a_replayed_step_is_refused(consortium, trained, stub):
    run, model, *_ = trained
    with refused(consortium, Code.FAILED_PRECONDITION, "step 1", "a key serves one step"):
        stub.Step(owner_pb2.StepRequest(run=RUN, round=1, weights=[float_tensor(p.detach().numpy())
                                                                    for p in model.parameters()]), timeout=30)
    with refused(consortium, Code.FAILED_PRECONDITION, "keyed once"):
        stub.Keys(owner_pb2.KeysRequest(run=RUN, round=TRAINED, batch=1), timeout=30)


def test_weights_of_another_shape_are_refused(consortium, trained, stub):
    _, model, *_ = trained
    shapes = [tuple(p.shape) for p in model.parameters()]
    stub.Keys(owner_pb2.KeysRequest(run=RUN, round=TRAINED + 1, batch=1), timeout=30)
    wrong = _weights([shapes[0][:-1] + (shapes[0][-1] + 1,), *shapes[1:]])
    with refused(consortium, Code.INVALID_ARGUMENT, "weights[0]", "is not the model's"):
        stub.Step(owner_pb2.StepRequest(run=RUN, round=TRAINED + 1, weights=wrong), timeout=30)
    stub.Keys(owner_pb2.KeysRequest(run=RUN, round=TRAINED + 2, batch=1), timeout=30)
    with refused(consortium, Code.INVALID_ARGUMENT, "tensors", "parameters"):
        stub.Step(owner_pb2.StepRequest(run=RUN, round=TRAINED + 2, weights=_weights(shapes[:-1])), timeout=30)


def test_a_step_past_the_admitted_ones_is_refused(consortium, trained, stub):
    with refused(consortium, Code.PERMISSION_DENIED, f"admitted for {ADMITTED} steps", f"round {ADMITTED + 1}"):
        stub.Keys(owner_pb2.KeysRequest(run=RUN, round=ADMITTED + 1, batch=1), timeout=30)
    with refused(consortium, Code.PERMISSION_DENIED, f"admitted for {ADMITTED} steps"):
        stub.Step(owner_pb2.StepRequest(run=RUN, round=ADMITTED + 1), timeout=30)


@pytest.mark.parametrize("terms, mechanism, code, words", [
    ({"model": "os:system"}, "dpsgd", Code.PERMISSION_DENIED, ("model 'os:system' is not registered", "no code")),
    ({"model": "conclave.learning.models.cnn:digits_cnn"}, "dpsgd", Code.PERMISSION_DENIED, ("not registered",)),
    ({"noise_multiplier": 0.3, "steps": ADMITTED}, "dpsgd", Code.PERMISSION_DENIED, ("at most ε 15 per run",)),
    ({}, "gnmax", Code.PERMISSION_DENIED, ("release through 'dpsgd'",)),
    ({"parties": ["hospital_a", "hospital_z"]}, "dpsgd", Code.PERMISSION_DENIED, ("not a declared peer",)),
    ({"records": 10}, "dpsgd", Code.INVALID_ARGUMENT, ("dpsgd.records",)),
    ({"max_grad_norm": -1.0}, "dpsgd", Code.INVALID_ARGUMENT, ("max_grad_norm",)),
    ({"standardiser": owner_pb2.Standardiser(mean=[0.0], scale=[1.0])}, "dpsgd", Code.INVALID_ARGUMENT,
     ("dpsgd.standardiser", "per column of a table")),
])
def test_terms_outside_the_registry_or_the_policy_are_refused(consortium, trained, stub, terms, mechanism, code,
                                                              words):
    request = _admit(f"refused-{len(terms)}-{mechanism}", **terms)
    request.mechanism = mechanism
    with refused(consortium, code, *words):
        stub.Admit(request, timeout=60)
    # Nothing ended: the honest run is still admitted (its step past the admitted ones is refused as such).
    with pytest.raises(grpc.RpcError) as still:
        stub.Keys(owner_pb2.KeysRequest(run=RUN, round=ADMITTED + 1, batch=1), timeout=30)
    assert still.value.code() == Code.PERMISSION_DENIED and f"admitted for {ADMITTED} steps" in still.value.details()


def test_a_step_key_with_other_terms_is_refused(consortium, trained):
    """Last (it ends the honest run): a coordinator lowering z in one owner's step key, or sending a
    step's keys to Votes, is refused before any charge."""
    channels = [consortium.stub(owner) for owner in OWNERS]
    try:
        for _, owner_stub in channels:
            owner_stub.Admit(_admit("dpsgd-swap"), timeout=60)
        keys = [owner_stub.Keys(owner_pb2.KeysRequest(run="dpsgd-swap", round=1, batch=1), timeout=30)
                for _, owner_stub in channels]
        _, stub_a = channels[0]
        tampered = owner_pb2.SignedKey()
        tampered.CopyFrom(keys[1])
        tampered.sigma = Z / 10
        with refused(consortium, Code.PERMISSION_DENIED, "hospital_b", "not signed by that owner"):
            stub_a.Step(owner_pb2.StepRequest(run="dpsgd-swap", round=1, parties=[keys[0], tampered, keys[2]],
                                              weights=_weights([tuple(p.shape) for p in build_model(
                                                  "digits_cnn", 10, input_shape=(1, 8, 8)).parameters()])),
                        timeout=30)
        with refused(consortium, Code.PERMISSION_DENIED, "DP-SGD run", "not votes"):
            stub_a.Votes(owner_pb2.VotesRequest(run="dpsgd-swap", round=1, parties=keys), timeout=30)
    finally:
        for channel, _ in channels:
            channel.close()
