"""Teacher votes through the secure sum on real Ray actors (three hospitals' CSV owners, one
teacher actor each) behind the real gRPC aggregator on 127.0.0.1: noised totals with the planned
noise, the ledger charged for the rounds that ran, and an owner whose actor dies refusing the
batch with nothing released or charged; and (in this process) a charged batch whose answers
cannot be recorded answered all the same."""
from __future__ import annotations

import errno
import inspect
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import ray

from grpc_health.v1 import health_pb2, health_pb2_grpc

from conclave.actors.aggregator import AggregatorServer, ServerSettings
from conclave.actors.labeller import input_keys, labeller_for
from conclave.actors.owners import OwnerDropout
from conclave.actors.owners import OwnerSource
from conclave.actors.teacher import OwnerShare, TeacherPool
from conclave.cluster.client import AggregatorClient
from conclave.cluster.config import load_yaml
from conclave.cluster.owners import PublicData, owner_data
from conclave.cluster.pipelines import load_pipeline
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.filter import filter_for
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.mechanisms import SecureGNMax
from conclave.privacy.noise import NoisePolicy
from conclave.privacy.secure_votes import SkellamVotes
from conclave.learning.train_config import TrainConfig

from tests.aggregators import wait_for

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DELTA = 1e-5
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def hospitals(ray_session):
    """Two teachers per hospital (configs/hospitals.yaml's three CSVs), on one actor each, each actor a party
    of the secure sum; and the public pool's rows."""
    config = load_pipeline(load_yaml(PROJECT_ROOT / "configs" / "hospitals.yaml")).config
    public = PublicData.read(config.public.anchored(str(PROJECT_ROOT)), config.test.anchored(str(PROJECT_ROOT)),
                             config.classes)
    shares = [OwnerShare(OwnerSource(owner.name, owner_data(owner, public.reading, str(PROJECT_ROOT)), 2,
                                     public.classes, records=owner.records), 2)
              for owner in config.owners]
    pool = TeacherPool(shares, "logistic_regression", TrainConfig(epochs=40, batch_size=8, lr=0.05),
                       num_cpus_per_actor=0.3, standardiser=public.standardiser)
    pool.train(progress=False)
    yield pool, public.splits.public.x.astype(np.float32)
    pool.shutdown()


def test_a_round_is_the_clean_histogram_plus_skellam_noise_of_the_planned_variance(hospitals):
    """Three owners: each adds σ²/2, so every owner faces σ² from the others and the aggregator
    the whole 1.5σ². Compared against the clean votes of the trusted path (for this test only)."""
    pool, inputs = hospitals
    sigma = 4.0
    clean = pool.votes(inputs)
    assert (clean.sum(axis=1) == 6).all()
    charged = []
    noise = np.concatenate([pool.noised_votes(inputs, SkellamVotes(sigma), NoisePolicy(), lambda: charged.append(1))
                            - clean for _ in range(4)]).ravel()
    assert len(charged) == 4  # each round asks to be charged before its shares
    variance, n = 1.5 * sigma**2, noise.size
    assert n == 4 * len(inputs) * 2 and noise.dtype == np.int64
    assert abs(noise.mean()) < 5 * math.sqrt(variance / n)
    assert abs(noise.var() - variance) < 5 * variance * math.sqrt(2 / n)


def test_the_aggregator_charges_the_skellam_curve_of_what_it_answered_and_keeps_no_votes(hospitals, tmp_path):
    pool, inputs = hospitals
    mechanism = SecureGNMax(3.0)
    planned = mechanism.worst_case_charge(30).for_records(Neighbouring.ADD_REMOVE, "one teacher per record")
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite", DELTA, filter_for(planned, 50.0, DELTA))
    server = AggregatorServer(pool, mechanism, ledger, pool.input_shape, ServerSettings(token="t"))
    try:
        with AggregatorClient(server.start(), token="t") as client:
            labels = np.concatenate([client.label(inputs[:20]), client.label(inputs[10:30])])
            budget = client.budget()
        assert set(labels.tolist()) <= {0, 1} and budget["queries_answered"] == 30 and budget["cache_hits"] == 10
        assert budget["mechanism"] == "secure-gnmax"
        report = ledger.report()
        assert report.charges == 2 and set(report.by_label) == {"secure-gnmax"}
        # 20 then 10 new answers: the ledger holds exactly the curve of 30 answers at σ = 3.
        reference = PrivacyLedger(tmp_path / "reference.sqlite", DELTA, None)
        reference.charge(mechanism.run_charge(30, 30).for_records(Neighbouring.ADD_REMOVE, "one teacher per record"))
        assert report.epsilon_spent == pytest.approx(reference.report().epsilon_spent, rel=1e-9)
        reference.close()
        with pytest.raises(RuntimeError, match="never sees clean votes"):
            server.answered_votes()
    finally:
        server.stop()
        ledger.close()


def _stall(actor, where: str, seconds: float) -> None:
    """Make one real teacher actor slow: its next votes (``where="votes"``: after it sent its key,
    inside its share) or its whole queue (``"queue"``: before its key) take ``seconds`` longer."""
    if where == "votes":
        actor.__ray_call__.remote(lambda group: setattr(group, "votes", (lambda votes: lambda inputs: (
            time.sleep(seconds), votes(inputs))[1])(group.votes)))
    else:
        actor.__ray_call__.remote(lambda group: time.sleep(seconds))


def _unstall(actor) -> None:
    ray.get(actor.__ray_call__.remote(lambda group: group.__dict__.pop("votes", None)), timeout=60)


def _timed_label(client: AggregatorClient, rows: np.ndarray) -> tuple[grpc.StatusCode, str, float]:
    """A Label call that is expected to fail: its status, message and seconds."""
    started = time.monotonic()
    try:
        client.label(rows)
    except grpc.RpcError as err:
        return err.code(), err.details(), time.monotonic() - started
    return grpc.StatusCode.OK, "", time.monotonic() - started


def _references() -> str:
    """Every object reference this process (the aggregator's) holds, as Ray counts them."""
    return str(ray._private.worker.global_worker.core_worker.get_all_reference_counts())


@pytest.mark.parametrize("stalled", ["share", "key"])
def test_a_stalled_owner_fails_the_call_unavailable_before_the_clients_deadline_and_nothing_is_answered(
        hospitals, tmp_path, monkeypatch, stalled):
    """hospital_c's actor stalls past the round's deadline: after its key (the round's shares were
    asked: the round is charged, since whoever holds the aggregator could decode it once the late
    share comes; here the share is cancelled and no reference to it kept), or before (nothing
    asked, nothing charged). Either way the client gets UNAVAILABLE, and so do the calls that came
    meanwhile, within one round's deadline (they do not wait it out again after it); no label and
    no answer is recorded, health turns NOT_SERVING until the owner is free, and the next call is
    answered."""
    pool, inputs = hospitals
    mechanism = SecureGNMax(3.0)
    planned = mechanism.worst_case_charge(40).for_records(Neighbouring.ADD_REMOVE, "one teacher per record")
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite", DELTA, filter_for(planned, 50.0, DELTA))
    monkeypatch.setattr(pool, "share_timeout_s", 2.0)
    cancelled = []
    cancel = ray.cancel
    monkeypatch.setattr(ray, "cancel", lambda ref, **kwargs: (cancelled.append(ref.hex()), cancel(ref, **kwargs)))
    server = AggregatorServer(pool, mechanism, ledger, pool.input_shape, ServerSettings(token="t", health_interval=0.3))
    victim = pool.roster.actors[2]  # hospital_c's only teacher actor
    try:
        with AggregatorClient(server.start(), token="t") as client, grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert client.label(inputs[60:62]).shape == (2,)
            before = ledger.report()
            _stall(victim, "votes" if stalled == "share" else "queue", 6.0)
            with ThreadPoolExecutor(3) as callers:
                calls = [callers.submit(_timed_label, client, inputs[62:67])]
                time.sleep(0.3)  # the first call's round is under way: these two wait for it
                calls += [callers.submit(_timed_label, client, rows) for rows in (inputs[67:69], inputs[69:71])]
                outcomes = [call.result() for call in calls]
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == NOT_SERVING
            _unstall(victim)
            after = ledger.report()
            assert all(code == grpc.StatusCode.UNAVAILABLE for code, _, _ in outcomes), outcomes
            assert max(took for _, _, took in outcomes) < 2 * pool.share_timeout_s  # not one deadline after another
            refused = outcomes[0][1]
            if stalled == "share":
                assert refused.startswith("owner hospital_c sent no share of a secure vote round within 2 s: the "
                                          "round is aborted; its shares were asked")
                # Charged as one round of the 5 inputs at σ = 3, beside the 2 answered before.
                with PrivacyLedger(tmp_path / "reference.sqlite", DELTA, None) as reference:
                    reference.charge(mechanism.run_charge(7, 7).for_records(Neighbouring.ADD_REMOVE,
                                                                            "one teacher per record"))
                    expected = reference.report().epsilon_spent
                assert after.charges == before.charges + 1 and after.epsilon_spent == pytest.approx(expected, rel=1e-9)
                assert len(cancelled) == 1  # hospital_c's share; the others had come in
            else:
                assert "owner hospital_c sent no key for a secure vote round" in refused
                assert (after.charges, after.epsilon_spent) == (before.charges, before.epsilon_spent)
                assert len(cancelled) == 1  # its key call
            assert server.budget().queries_answered == 2  # nothing recorded as answered
            assert not set(input_keys(inputs[62:71])) & set(ledger.answers.read())
            wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING, 60)
            assert not [ref for ref in cancelled if ref in _references()]  # no reference to it is left
            assert client.label(inputs[62:67]).shape == (5,)
            assert server.budget().queries_answered == 7
    finally:
        _unstall(victim)
        server.stop()
        ledger.close()


def test_a_secure_batch_fits_within_the_clients_deadline():
    """Confident-GNMax's two rounds at their longest end before the client gives up, as one vote does."""
    client_deadline = inspect.signature(AggregatorClient).parameters["timeout"].default
    assert 2 * TeacherPool.share_timeout_s < client_deadline and TeacherPool.vote_timeout_s < client_deadline


def test_an_owner_whose_actor_dies_aborts_the_batch_with_nothing_released_or_charged(hospitals, tmp_path, caplog):
    """Last in this module: it kills hospital_b's actor (the module's pool is the one to break)."""
    pool, inputs = hospitals
    mechanism = SecureGNMax(3.0)
    planned = mechanism.worst_case_charge(40).for_records(Neighbouring.ADD_REMOVE, "one teacher per record")
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite", DELTA, filter_for(planned, 50.0, DELTA))
    server = AggregatorServer(pool, mechanism, ledger, pool.input_shape, ServerSettings(token="t"))
    try:
        with AggregatorClient(server.start(), token="t") as client:
            assert client.label(inputs[40:50]).shape == (10,)
            before = ledger.report()
            ray.kill(pool.roster.actors[1], no_restart=True)  # hospital_b's only teacher actor
            with caplog.at_level(logging.WARNING, logger="conclave.actors.labeller"), \
                    pytest.raises(grpc.RpcError) as refused:
                client.label(inputs[50:60])
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "owner hospital_b dropped out" in refused.value.details()
        after = ledger.report()
        assert (after.charges, after.epsilon_spent) == (before.charges, before.epsilon_spent)
        assert server.budget().queries_answered == 10
        dropped = [r.getMessage() for r in caplog.records if "dropped out" in r.getMessage()]
        assert len(dropped) == 1 and "hospital_b" in dropped[0] and "nothing released or charged" in dropped[0]
        with pytest.raises(OwnerDropout, match="owner hospital_b"):
            pool.noised_votes(inputs[:5], SkellamVotes(3.0), NoisePolicy(), lambda: None)
    finally:
        server.stop()
        ledger.close()


class EchoRounds:
    """A secure vote source in this process: every round charges, then returns three votes for class 0."""

    neighbouring, neighbouring_lemma = Neighbouring.ADD_REMOVE, "one teacher per record"
    batch_coupled, num_classes, local = False, 4, False

    def ready(self, timeout: float = 2.0) -> bool:
        return True

    def noised_votes(self, inputs, release, noise, charge) -> np.ndarray:
        charge()
        histogram = np.zeros((len(inputs), 4), dtype=np.int64)
        histogram[:, 0] = 3
        return histogram


def test_a_charged_batch_whose_answers_cannot_be_recorded_is_answered_and_repeated_free(tmp_path, monkeypatch):
    # Before: the rounds were charged, then recording the answers failed (a full disk), and the client
    # was told nothing was released or charged; asked again, it was charged again.
    with PrivacyLedger(tmp_path / "ledger.sqlite", DELTA) as ledger:
        labeller = labeller_for(EchoRounds(), SecureGNMax(3.0), ledger, NoisePolicy())

        def full_disk(answers):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(ledger.answers, "record", full_disk)
        inputs = np.random.default_rng(5).random((3, 4), dtype=np.float32)
        labels = labeller.label(inputs).labels
        charges = ledger.report().charges
        assert charges >= 1 and len(labels) == 3
        assert (labeller.label(inputs).labels == labels).all() and ledger.report().charges == charges
