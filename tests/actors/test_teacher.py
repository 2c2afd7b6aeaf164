"""Teacher actors: packing, parallel training, and histograms that are the only thing out."""
from __future__ import annotations

import numpy as np
import pytest

from actors.teacher import TeacherGroup, TeacherPool, gpu_share
from learning.data import make_splits, shard
from learning.training import TrainConfig

TRAIN = TrainConfig(epochs=6, batch_size=32, lr=3e-3, seed=0)


@pytest.fixture(scope="module")
def digits():
    splits = make_splits("digits", public_size=200, seed=0)
    return splits, shard(splits.private, 5, seed=0)


@pytest.fixture(scope="module")
def pool(ray_session, digits):
    _, shards = digits
    pool = TeacherPool(shards, "digits_cnn", TRAIN, num_actors=2, seed=3, num_cpus_per_actor=0.5)
    losses = pool.train(progress=False)
    yield pool, losses
    pool.shutdown()


def test_teachers_are_packed_several_per_actor(pool):
    teachers, _ = pool
    assert teachers.num_teachers == 5
    assert teachers.num_actors == 2
    assert teachers.num_classes == 10
    assert teachers.input_shape == (1, 8, 8)


def test_training_reports_one_finite_loss_per_teacher(pool):
    _, losses = pool
    assert len(losses) == 5
    assert all(np.isfinite(loss) and 0 < loss < 2.3 for loss in losses)  # below chance's log(10)


def test_votes_are_a_histogram_with_one_vote_per_teacher(pool, digits):
    teachers, _ = pool
    splits, _ = digits
    votes = teachers.votes(splits.public.x)
    assert votes.dtype == np.int64
    assert votes.shape == (200, 10)
    assert (votes >= 0).all() and (votes.sum(axis=1) == 5).all()
    # Trained teachers agree with the truth far above chance (0.1).
    assert (votes.argmax(axis=1) == splits.public.y).mean() > 0.7


def test_packing_does_not_change_the_teachers(pool, digits):
    """The same teachers in one process (no Ray) vote exactly as the actor pool does."""
    teachers, _ = pool
    splits, shards = digits
    in_process = TeacherGroup(shards, "digits_cnn", TrainConfig(epochs=6, batch_size=32, lr=3e-3, seed=3))
    in_process.train_all()
    np.testing.assert_array_equal(in_process.votes(splits.public.x[:64]), teachers.votes(splits.public.x[:64]))


def test_votes_reject_inputs_of_the_wrong_shape(pool):
    teachers, _ = pool
    with pytest.raises(ValueError, match="teachers expect"):
        teachers.votes(np.zeros((3, 1, 28, 28), dtype=np.float32))


def test_untrained_teachers_refuse_to_vote(digits):
    _, shards = digits
    with pytest.raises(RuntimeError, match="trained"):
        TeacherGroup(shards[:1], "digits_cnn", TRAIN).votes(shards[0].x[:2])


def test_gpu_requests_only_when_the_cluster_has_gpus():
    assert gpu_share(0.0, 4) == 0.0
    assert gpu_share(2.0, 4) == 0.5
    assert gpu_share(8.0, 2) == 1.0


def test_more_actors_than_teachers_is_capped(ray_session, digits):
    _, shards = digits
    pool = TeacherPool(shards[:2], "digits_cnn", TRAIN, num_actors=8, num_cpus_per_actor=0.25)
    try:
        assert pool.num_actors == 2
    finally:
        pool.shutdown()
