"""Teacher votes through the secure sum on real Ray actors (three hospitals' CSV owners, one
teacher actor each) behind the real gRPC aggregator on 127.0.0.1: noised totals with the planned
noise, the ledger charged for the rounds that ran, and an owner whose actor dies refusing the
batch with nothing released or charged."""
from __future__ import annotations

import logging
import math
from pathlib import Path

import grpc
import numpy as np
import pytest
import ray

from conclave.actors.aggregator import AggregatorServer, ServerSettings
from conclave.actors.owners import OwnerDropout
from conclave.cluster.client import AggregatorClient
from conclave.cluster.config import load_yaml
from conclave.cluster.teaching.ensemble import checked_public, resolved, teacher_pool
from conclave.cluster.run_command import load_run_config
from conclave.privacy.accounting.charge import ADD_REMOVE
from conclave.privacy.accounting.filter import filter_for
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.mechanisms import SecureGNMax
from conclave.privacy.noise import NoisePolicy
from conclave.privacy.secure_votes import SkellamVotes

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DELTA = 1e-5


def _hospitals(teachers: int):
    """configs/hospitals.yaml with ``teachers`` per owner (three owners, one actor each)."""
    raw = load_yaml(PROJECT_ROOT / "configs" / "hospitals.yaml")
    raw.update(owners=[{**owner, "teachers": teachers} for owner in raw["owners"]], aggregation="secure")
    return load_run_config(raw)[1]


@pytest.fixture(scope="module")
def hospitals(ray_session):
    """Two teachers per hospital, on one actor each; and the public pool's rows."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(PROJECT_ROOT)  # the config's paths are the project root's
        config = _hospitals(2)
        public = checked_public(config)
        pool = teacher_pool(resolved(config, public), public)
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
    noise = np.concatenate([pool.noised_votes(inputs, SkellamVotes(sigma), NoisePolicy()) - clean
                            for _ in range(4)]).ravel()
    variance, n = 1.5 * sigma**2, noise.size
    assert n == 4 * len(inputs) * 2 and noise.dtype == np.int64
    assert abs(noise.mean()) < 5 * math.sqrt(variance / n)
    assert abs(noise.var() - variance) < 5 * variance * math.sqrt(2 / n)


def test_the_aggregator_charges_the_skellam_curve_of_what_it_answered_and_keeps_no_votes(hospitals, tmp_path):
    pool, inputs = hospitals
    mechanism = SecureGNMax(3.0)
    planned = mechanism.worst_case_charge(30).for_records(ADD_REMOVE, "one teacher per record")
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
        reference.charge(mechanism.run_charge(30, 30).for_records(ADD_REMOVE, "one teacher per record"))
        assert report.epsilon_spent == pytest.approx(reference.report().epsilon_spent, rel=1e-9)
        reference.close()
        with pytest.raises(RuntimeError, match="never sees clean votes"):
            server.answered_votes()
    finally:
        server.stop()
        ledger.close()


def test_an_owner_whose_actor_dies_aborts_the_batch_with_nothing_released_or_charged(hospitals, tmp_path, caplog):
    """Last in this module: it kills hospital_b's actor (each owner's custom resource admits one
    pool at a time on the test node, so the module's pool is the one to break)."""
    pool, inputs = hospitals
    mechanism = SecureGNMax(3.0)
    planned = mechanism.worst_case_charge(40).for_records(ADD_REMOVE, "one teacher per record")
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite", DELTA, filter_for(planned, 50.0, DELTA))
    server = AggregatorServer(pool, mechanism, ledger, pool.input_shape, ServerSettings(token="t"))
    try:
        with AggregatorClient(server.start(), token="t") as client:
            assert client.label(inputs[40:50]).shape == (10,)
            before = ledger.report()
            ray.kill(pool._actors[1], no_restart=True)  # hospital_b's only teacher actor
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
            pool.noised_votes(inputs[:5], SkellamVotes(3.0), NoisePolicy())
    finally:
        server.stop()
        ledger.close()
