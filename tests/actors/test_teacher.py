"""Teacher actors: their own shards, packing, parallel training, and histograms that are
the only thing out."""
from __future__ import annotations

import dataclasses
import re

import grpc
import numpy as np
import pytest

import conclave.learning.data as learning_data
from conclave.actors.aggregator import AggregatorServer, ServerSettings
from conclave.actors.teacher import TeacherGroup, TeacherPool, TeacherSource, gpu_share
from conclave.cluster.client import AggregatorClient
from conclave.learning.data import Dataset, make_splits, shard
from conclave.learning.data.features import apply_features
from conclave.learning.train_config import TrainConfig
from conclave.learning.training import predict
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.mechanisms import build_mechanism

TRAIN = TrainConfig(epochs=6, batch_size=32, lr=3e-3, seed=0)


@pytest.fixture(scope="module")
def digits():
    """The student's side of the digits splits and the spec of five teachers' shards."""
    splits = make_splits("digits", public_size=200, seed=0).student_side()
    return splits, TeacherSource("digits", None, public_size=200, num_teachers=5, seed=0)


@pytest.fixture(scope="module")
def pool(ray_session, digits):
    _, source = digits
    pool = TeacherPool.of_source(source, 5, "digits_cnn", TRAIN, num_actors=2, seed=3, num_cpus_per_actor=0.5)
    pool.vote_timeout_s = 120.0  # these tests are about the votes, not the service's deadline: room for a loaded machine
    pool.train(progress=False)
    yield pool
    pool.shutdown()


@pytest.mark.parametrize("private_size", [None, 700])
def test_source_loads_the_shards_the_driver_used_to_cut(private_size):
    """Same data, order and names as ``shard(make_splits(...).private, ...)``, so moving the
    loading into the actors changes no result."""
    source = TeacherSource("digits", None, public_size=200, num_teachers=5, seed=4, private_size=private_size)
    expected = shard(make_splits("digits", public_size=200, seed=4, private_size=private_size).private, 5, seed=4)
    for ids in ([0, 1, 2, 3, 4], [3, 1]):
        loaded = source.load(ids)
        assert len(loaded) == len(ids)
        for got, want in zip(loaded, [expected[i] for i in ids]):
            np.testing.assert_array_equal(got.x, want.x)
            np.testing.assert_array_equal(got.y, want.y)
            assert (got.name, got.num_classes) == (want.name, want.num_classes)


@pytest.mark.parametrize("ids", [[], [5], [-1, 0]])
def test_source_refuses_teachers_it_does_not_have(ids):
    with pytest.raises(ValueError, match="teacher ids"):
        TeacherSource("digits", None, public_size=200, num_teachers=5).load(ids)


def _private_data_in(value) -> list[str]:
    """Every array or Dataset reachable from ``value`` through containers and dataclasses."""
    if isinstance(value, (np.ndarray, Dataset)):
        return [repr(value)]
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set)):
        items = list(value)
    elif dataclasses.is_dataclass(value):
        items = [getattr(value, f.name) for f in dataclasses.fields(value)]
    else:
        return []
    return [found for item in items for found in _private_data_in(item)]


def test_a_group_keeps_its_shards_as_features_and_reports_the_image_shape(digits):
    _, source = digits
    group = TeacherGroup(dataclasses.replace(source, features="scattering"), 0, 2, "scatternet_cnn", TRAIN)
    assert [shard.input_shape for shard in group.shards] == [(81, 2, 2)] * 2  # 81 maps of 8/4 × 8/4
    info = group.describe()
    assert (info.num_classes, info.input_shape) == (10, (1, 8, 8))


def test_teachers_on_scattering_features_take_images_and_the_driver_never_loads_private_shards(
        ray_session, digits, tmp_path, monkeypatch, capsys, caplog):
    """A real pool built from the spec trains and votes while every way of reading a dataset is a
    tripwire in this (the driver's) process; the actors run in their own processes, unpatched, and
    load their shards there. The pool keeps no data either, and its progress bar and log lines say
    how many teachers trained, never how long they took. Each actor computes the features of its
    shards and of every query itself, so the pool takes images, reports the image shape, and the
    aggregator validates images against it."""
    splits, source = digits

    def tripwire(*args, **kwargs):
        raise AssertionError("the driver read a dataset")

    monkeypatch.setattr(TeacherSource, "load", tripwire)
    monkeypatch.setattr(learning_data, "load_dataset", tripwire)
    pool = TeacherPool.of_source(dataclasses.replace(source, features="scattering"), 3, "scatternet_cnn",
                       dataclasses.replace(TRAIN, epochs=15), num_actors=2, num_cpus_per_actor=0.5)
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite", 1e-5)
    server = AggregatorServer(pool, build_mechanism("gnmax", sigma=1.0), ledger, pool.input_shape,
                              ServerSettings(host="127.0.0.1", port=0, token="t"))
    try:
        assert (pool.num_classes, pool.input_shape) == (10, (1, 8, 8))
        caplog.set_level("INFO", logger="conclave")
        assert pool.train() is None  # nothing about the training comes back
        bar = capsys.readouterr().err
        assert "3/3 teachers" in bar and not re.search(r"/s|\d:\d\d|\d s\b", bar + caplog.text), bar + caplog.text
        votes = pool.votes(splits.public.x)
        assert votes.shape == (200, 10) and (votes.sum(axis=1) == 3).all()
        assert (votes.argmax(axis=1) == splits.public.y).mean() > 0.7  # chance is 0.1
        assert _private_data_in(vars(pool)) == []
        with AggregatorClient(server.start(), "t") as client:
            assert client.label(splits.public.x[:20]).shape == (20,)
            with pytest.raises(grpc.RpcError) as refused:  # features are not what clients send
                client.label(apply_features(splits.public, "scattering").x[:20])
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        server.stop()
        ledger.close()
        pool.shutdown()


def test_teachers_are_packed_several_per_actor(pool):
    teachers = pool
    assert teachers.num_teachers == 5
    assert teachers.num_actors == 2
    assert teachers.num_classes == 10
    assert teachers.input_shape == (1, 8, 8)


def test_the_health_probe_is_answered_while_a_long_vote_runs(pool, digits):
    """An actor votes one batch at a time; its readiness probe has a thread of its own, so a
    long vote is never mistaken for a lost teacher (health would turn NOT_SERVING)."""
    import ray

    many = np.tile(digits[0].public.x, (1000, 1, 1, 1))  # 200,000 inputs: seconds of voting
    actor = pool.roster.actors[0]
    voting = actor.votes.remote(ray.put(many))
    assert ray.get(actor.is_trained.remote(), timeout=30)
    assert ray.wait([voting], timeout=0)[1] == [voting]  # the probe came back first
    ray.cancel(voting, force=False)


def test_the_pool_states_the_record_level_relation_its_shards_give(pool):
    assert pool.neighbouring == "add-remove" and "keyed hash" in pool.neighbouring_lemma


def test_a_teacher_whose_hashed_shard_is_empty_still_votes():
    # 20 records hashed over 20 teachers: about a third of the shards are empty
    source = TeacherSource("digits", None, public_size=200, num_teachers=20, seed=0, private_size=20)
    group = TeacherGroup(source, 0, 20, "digits_cnn", dataclasses.replace(TRAIN, epochs=1))
    assert any(len(shard) == 0 for shard in group.shards)
    assert group.train_all() is None  # nothing about the training leaves
    votes = group.votes(make_splits("digits", public_size=200, seed=0).public.x[:10])
    assert (votes.sum(axis=1) == 20).all()


def test_the_stacked_teachers_vote_as_the_teachers_do_one_by_one(digits):
    """``votes`` runs the teachers stacked into one network; the histogram is the one their
    predictions make one teacher at a time."""
    splits, source = digits
    group = TeacherGroup(source, 0, 5, "digits_cnn", TrainConfig(epochs=2, batch_size=32, lr=3e-3, seed=3))
    group.train_all()
    x = splits.public.x[:64]
    expected = np.zeros((len(x), 10), dtype=np.int64)
    for model in group.models:
        expected[np.arange(len(x)), predict(model, x)] += 1
    assert len(np.unique(expected.argmax(axis=1))) >= 3
    np.testing.assert_array_equal(group.votes(x), expected)


def test_votes_are_a_histogram_with_one_vote_per_teacher(pool, digits):
    teachers = pool
    splits, _ = digits
    votes = teachers.votes(splits.public.x)
    assert votes.dtype == np.int64
    assert votes.shape == (200, 10)
    assert (votes >= 0).all() and (votes.sum(axis=1) == 5).all()
    # Trained teachers agree with the truth far above chance (0.1).
    assert (votes.argmax(axis=1) == splits.public.y).mean() > 0.7


def test_packing_does_not_change_the_teachers(pool, digits):
    """The same teachers in one process (no Ray) vote exactly as the actor pool does."""
    teachers = pool
    splits, source = digits
    in_process = TeacherGroup(source, 0, 5, "digits_cnn", TrainConfig(epochs=6, batch_size=32, lr=3e-3, seed=3))
    in_process.train_all()
    np.testing.assert_array_equal(in_process.votes(splits.public.x[:64]), teachers.votes(splits.public.x[:64]))


def test_votes_reject_inputs_of_the_wrong_shape(pool):
    teachers = pool
    with pytest.raises(ValueError, match="inputs of shape"):
        teachers.votes(np.zeros((3, 1, 28, 28), dtype=np.float32))


def test_untrained_teachers_refuse_to_vote(digits):
    splits, source = digits
    with pytest.raises(RuntimeError, match="trained"):
        TeacherGroup(source, 0, 1, "digits_cnn", TRAIN).votes(splits.public.x[:2])


def test_gpu_requests_only_when_the_cluster_has_gpus():
    assert gpu_share(0.0, 4) == 0.0
    assert gpu_share(2.0, 4) == 0.5
    assert gpu_share(8.0, 2) == 1.0


def test_more_actors_than_teachers_is_capped(ray_session, digits):
    _, source = digits
    pool = TeacherPool.of_source(source, 1, "digits_cnn", TRAIN, num_actors=8, num_cpus_per_actor=0.25)
    try:
        assert pool.num_actors == 1  # one actor started, not eight
    finally:
        pool.shutdown()


@pytest.mark.parametrize("count", [0, 6])
def test_a_pool_trains_only_teachers_its_source_has(digits, count):
    _, source = digits
    with pytest.raises(ValueError, match="num_teachers"):
        TeacherPool.of_source(source, count, "digits_cnn", TRAIN, num_actors=1)
