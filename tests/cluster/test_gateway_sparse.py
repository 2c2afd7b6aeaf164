"""Sparse DP fine-tuning through the owners' gateways (real gRPC over mutual TLS on 127.0.0.1, real ledgers,
a small registered GroupNorm CNN): the sparse_finetune pipeline pre-trains on public digits 0–4, then each
variant's public weights and public mask are admitted at three gateways, every step a secure sum of the
owners' masked shares of the trained entries' clipped gradients (d = those entries alone). Each owner's
ledger holds one charge per step of every variant, which compose to the run's guarantee; frozen entries
never move. A mask past the model, pre-trained weights of another shape, model arguments it does not
take, a step past the schedule or of the wrong kind, an unregistered model, NearPrivate beside a sparse
run and a policy that does not admit sparse_finetune are each refused in one line, nothing charged."""
from __future__ import annotations

import dataclasses
import json

import grpc
import numpy as np
import pytest
import torch

from conclave.cluster.api import SparseFinetune
from conclave.cluster.gateway.client import float_tensor
from conclave.cluster.gateway.dpsgd_client import DpsgdTerms, GatewayDpsgd, SparseTerms
from conclave.cluster.owners import DataOwner, GatewaysConfig
from conclave.cluster.pipelines import RunContext
from conclave.cluster.results import RunDirectory
from conclave.cluster.sparse_finetuning import (DataSpec, DPFinetuneConfig, ModelConfig, PretrainConfig, SparseConfig,
                                                validate)
from conclave.learning.data import load_digits
from conclave.learning.data.sources import DataSource
from conclave.learning.dp_schedule import secure_charge
from conclave.learning.models.resnet import gn_cnn
from conclave.learning.sparse import plan_variant
from conclave.privacy.accounting.owner_policy import OwnerPolicy, write_policy
from conclave.privacy.accounting.ledger import read_ledger
from conclave.protos import owner_pb2
from tests.cluster.test_gateway_dpsgd import Code, refused
from tests.gateways import CLASSES, OWNERS, gateways_serving, make_consortium

CHANNELS, FRACTION, ADMITTED = 4, 0.05, 4


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sparse")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONCLAVE_HOME", str(directory / "home"))
        with gateways_serving(make_consortium(directory, epsilon=100.0, max_run_epsilon=10.0)) as running:
            yield running


@pytest.fixture(scope="module")
def finetuned(consortium, tmp_path_factory):
    """The pipeline through the three gateways: classifier and all, 5 steps each (the declared 1200 records
    at batch 240), on the owners' digits 5–9 (the test file's classes), and each owner's ledger after it."""
    folder = tmp_path_factory.mktemp("sparse-run")
    _, test = load_digits()
    private = test.y >= 5
    np.savez(folder / "test.npz", x=test.x[private], y=test.y[private].astype(str))
    tls = consortium.coordinator
    config = validate(SparseConfig(
        name="sparse-gateways", model=ModelConfig("gn_cnn", 1, {"channels": CHANNELS}),
        public=DataSpec("digits", classes=(0, 1, 2, 3, 4), size=300), pretrain=PretrainConfig(epochs=1),
        finetune=DPFinetuneConfig(variants=("classifier", "all"), fraction=FRACTION, epochs=1, batch_size=240,
                                  target_epsilon=2.0),
        owners=tuple(DataOwner(owner, gateway=consortium.servers[owner].address) for owner in OWNERS),
        test=DataSource("npz", str(folder / "test.npz"), label="y"),
        gateways=GatewaysConfig(str(tls.certificate), str(tls.key), str(tls.ca))))
    outcome = SparseFinetune(config).run(RunContext("sparse-gateways", RunDirectory(folder, "sparse-gateways")))
    ledgers = {owner: read_ledger(OwnerPolicy.load(owner).budget().ledger_path(owner)) for owner in OWNERS}
    return outcome, json.loads((folder / "sparse-gateways" / "privacy.json").read_text()), ledgers


def test_each_owner_pays_every_variants_steps_and_its_ledger_is_the_runs_guarantee(finetuned):
    outcome, privacy, ledgers = finetuned
    variants = outcome.metrics["variants"]
    assert [v["steps"] for v in variants.values()] == [5, 5] and variants["all"]["sample_rate"] == pytest.approx(0.2)
    assert variants["all"]["trained_entries"] > variants["classifier"]["trained_entries"] == 5 * (4 * CHANNELS + 1)
    assert privacy["spent"]["charges"] == 2 and privacy["sound"]  # the run's ledger: each variant's schedule
    guarantee = privacy["guarantee"]
    one = secure_charge(0.2, variants["all"]["noise_multiplier"], 1, "dpsgd")
    for owner, snapshot in ledgers.items():  # fresh ledgers: this run's charges alone
        assert snapshot.charges == 10 and set(snapshot.by_label) == {"dpsgd"}, owner
        np.testing.assert_allclose(snapshot.spent.rdp, 10 * one.rdp, rtol=1e-9)
        spent = privacy["owners"][owner]["spent"]  # as its gateway reports it (``Budget``) after the last step
        assert spent["epsilon"] == pytest.approx(guarantee["epsilon"], rel=1e-9), owner
        assert spent["charges"] == 10 and spent["charges_before_run"] == 0, owner
    assert guarantee["basis"] == "worst-case" and privacy["aggregation"] == "secure"
    assert outcome.metrics["shards"]["nodes"] == {}  # no node of the coordinator's holds an owner's records
    assert all(0.0 <= v["accuracy"] <= 1.0 for v in variants.values())


@pytest.fixture(scope="module")
def direct(consortium):
    """A sparse run admitted by GatewayDpsgd itself (ADMITTED steps, 2 taken): its model, plan and terms."""
    model = gn_cnn(len(CLASSES), 1, channels=CHANNELS)
    plan = plan_variant(model, "all", FRACTION)
    terms = DpsgdTerms("gn_cnn", max_grad_norm=1.0, noise_multiplier=1.0, sample_rate=0.1, steps=ADMITTED,
                       arguments=(("channels", CHANNELS),), sparse=SparseTerms.of(model, plan.masks))
    before = [p.detach().clone() for p in model.parameters()]
    run = GatewayDpsgd([consortium.gateway(owner) for owner in OWNERS], consortium.verifier, "sparse-direct", terms,
                       CLASSES)
    try:
        run.train(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9),
                  steps=2)
        yield model, plan, terms, before
    finally:
        run.shutdown()


def test_frozen_entries_never_move_and_a_step_key_signs_the_trained_entries_alone(consortium, direct):
    model, plan, _, before = direct
    for (name, parameter), initial in zip(model.named_parameters(), before):
        if not parameter.requires_grad:
            assert torch.equal(parameter.detach(), initial), name
        elif name in plan.masks:
            frozen = plan.masks[name] == 0
            assert torch.equal(parameter.detach()[frozen], initial[frozen]), name
            assert not torch.equal(parameter.detach()[~frozen], initial[~frozen]), name  # noised: it moved
    channel, stub = consortium.stub("hospital_a")
    with channel:
        key = stub.Keys(owner_pb2.KeysRequest(run="sparse-direct", round=3, batch=1), timeout=30)
        assert key.dimension == plan.trained_entries < sum(p.numel() for p in model.parameters())
        with refused(consortium, Code.INVALID_ARGUMENT, "weights", "trained entries"):
            stub.Step(owner_pb2.StepRequest(run="sparse-direct", round=3, weights=[
                float_tensor(p.detach().numpy()) for p in model.parameters()]), timeout=30)
        stub.Keys(owner_pb2.KeysRequest(run="sparse-direct", round=4, batch=1), timeout=30)
        with refused(consortium, Code.INVALID_ARGUMENT, "trained", f"[{plan.trained_entries}]"):
            stub.Step(owner_pb2.StepRequest(run="sparse-direct", round=4,
                                            trained=float_tensor(np.zeros(plan.trained_entries + 1, np.float32))),
                      timeout=30)
        with refused(consortium, Code.PERMISSION_DENIED, f"admitted for {ADMITTED} steps"):
            stub.Keys(owner_pb2.KeysRequest(run="sparse-direct", round=ADMITTED + 1, batch=1), timeout=30)


def _admit(run: str, terms: DpsgdTerms) -> owner_pb2.AdmitRequest:
    dpsgd = owner_pb2.DpsgdTerms(model=terms.model, max_grad_norm=1.0, noise_multiplier=1.0, sample_rate=0.1,
                                 steps=ADMITTED, parties=list(OWNERS), records=1200, sparse=terms.sparse.message(),
                                 arguments=[owner_pb2.ModelArgument(name="channels", integer=CHANNELS)])
    return owner_pb2.AdmitRequest(run=run, mechanism="dpsgd", classes=list(CLASSES), dpsgd=dpsgd)


def _unregistered(dpsgd: owner_pb2.DpsgdTerms) -> None:
    dpsgd.model = "os:system"


def _past_the_parameters(dpsgd: owner_pb2.DpsgdTerms) -> None:
    dpsgd.sparse.trained[-1].parameter = 99


def _past_an_entry(dpsgd: owner_pb2.DpsgdTerms) -> None:
    dpsgd.sparse.trained[-1].entries[:] = [0, 10**6]


def _pretrained_of_another_shape(dpsgd: owner_pb2.DpsgdTerms) -> None:
    dpsgd.sparse.pretrained[0].CopyFrom(float_tensor(np.zeros((2, 2), np.float32)))


def _an_argument_it_does_not_take(dpsgd: owner_pb2.DpsgdTerms) -> None:
    dpsgd.arguments.add(name="runtime_env", integer=1)


def _a_model_too_large_to_travel(dpsgd: owner_pb2.DpsgdTerms) -> None:
    dpsgd.arguments[0].integer = 10**5


def _near_private_beside_it(dpsgd: owner_pb2.DpsgdTerms) -> None:
    dpsgd.near_private.CopyFrom(owner_pb2.NearPrivateTerms(pca_epsilon=0.5, support_epsilon=0.5, delta=1e-5))


@pytest.mark.parametrize("change, code, words", [
    (_unregistered, Code.PERMISSION_DENIED, ("'os:system' is not registered",)),
    (_past_the_parameters, Code.INVALID_ARGUMENT, ("sparse.trained", "strictly increasing indices")),
    (_past_an_entry, Code.INVALID_ARGUMENT, ("sparse.trained", "below its")),
    (_pretrained_of_another_shape, Code.INVALID_ARGUMENT, ("sparse.pretrained[0]", "is not the model's")),
    (_an_argument_it_does_not_take, Code.INVALID_ARGUMENT, ("dpsgd.arguments", "takes channels")),
    (_a_model_too_large_to_travel, Code.INVALID_ARGUMENT, ("more than", "parameters")),
    (_near_private_beside_it, Code.INVALID_ARGUMENT, ("not with a sparse fine-tuning",)),
])
def test_sparse_terms_outside_the_model_or_the_protocol_are_refused(consortium, direct, change, code, words):
    _, _, terms, _ = direct
    request = _admit(f"refused{change.__name__}", terms)
    change(request.dpsgd)
    channel, stub = consortium.stub("hospital_a")
    with channel, refused(consortium, code, *words):
        stub.Admit(request, timeout=60)


def test_a_policy_that_does_not_admit_sparse_fine_tuning_refuses_it(consortium, direct):
    _, _, terms, _ = direct
    policy = OwnerPolicy.load("hospital_a")
    write_policy(dataclasses.replace(policy, pipelines=("active_learning",)))
    try:
        channel, stub = consortium.stub("hospital_a")
        with channel, refused(consortium, Code.PERMISSION_DENIED, "active_learning", "is sparse_finetune"):
            stub.Admit(_admit("refused-pipeline", terms), timeout=60)
    finally:
        write_policy(policy)
