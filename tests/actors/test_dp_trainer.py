"""Shard actors and data-parallel DP-SGD: private sums stay aggregates, the actors sum securely."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.dp_trainer import ModelSpec, PrivateSource, ShardGroup, ShardPlan, ShardSupport
from learning.dpsgd import DPSGDConfig, train_dp
from learning.embedding_stats import covariance_sum, support_counts
from learning.data import load_digits
from learning.selection.entropy import logit_entropy
from learning.training import embed, predict_logits
from privacy.counts import LaplaceCounts
from privacy.noise import SECURE
from privacy.pca import AnalyzeGauss

SOURCE = PrivateSource("digits", None, private_size=600, num_shards=2, seed=0)
MODEL = ModelSpec("digits_cnn", num_classes=10)


@pytest.fixture(scope="module")
def group(ray_session):
    with ShardGroup([ShardPlan(SOURCE, (0,)), ShardPlan(SOURCE, (1,))], MODEL, num_cpus=0.5) as group:
        yield group


@pytest.fixture(scope="module")
def actors(group):
    return group.actors


def test_private_sums_are_computed_inside_the_actors_and_equal_the_central_ones(ray_session, actors):
    state = {k: v.numpy() for k, v in MODEL.build().state_dict().items()}
    ray_session.get([a.set_weights.remote(state) for a in actors])

    union = SOURCE.load([0, 1])  # the central computation, for comparison only
    model = MODEL.build()
    embeddings = embed(model, union.x)
    entropy = logit_entropy(predict_logits(model, union.x))

    parts = ray_session.get([a.covariance_sum.remote() for a in actors])
    d = embeddings.shape[1]
    assert all(p.shape == (d, d) for p in parts)  # aggregate-shaped: no per-example rows cross
    np.testing.assert_allclose(sum(parts), covariance_sum(embeddings), rtol=1e-5, atol=1e-6)

    rng = np.random.default_rng(0)
    projection = np.linalg.qr(rng.normal(size=(d, 4)))[0]
    public_points = rng.normal(size=(30, 4)) * 0.3
    threshold = float(np.median(entropy))
    counts = ray_session.get([a.support_counts.remote(projection, public_points, threshold) for a in actors])
    assert all(c.shape == (30,) and c.dtype == np.int64 for c in counts)
    central = support_counts(embeddings, entropy, projection, public_points, threshold)
    np.testing.assert_array_equal(sum(counts), central)
    assert central.sum() == np.sum(entropy >= threshold)  # each voter counted once

    charged = []
    support = ShardSupport(actors, AnalyzeGauss(1.0, 1e-5), LaplaceCounts(0.5), charged.append, SECURE)
    released = support.dp_projection(4)
    noisy = support.noisy_support(released, public_points, threshold)
    assert released.shape == (d, 4) and noisy.shape == (30,)
    assert [c.label for c in charged] == ["dp-pca", "noisy-counts"]
    assert not np.array_equal(noisy, central)  # noise was added


def test_data_parallel_dpsgd_on_two_actors_sums_securely_is_charged_as_skellam_and_learns(group):
    from learning.dpsgd import dp_step_charge
    from privacy.accounting.rdp import epsilon_from_rdp

    config = DPSGDConfig(epochs=3, batch_size=60, lr=1.0, max_grad_norm=1.0, delta=1e-5, noise_multiplier=0.7)
    checkpoints = group.train(config, SECURE, num_examples=600)
    central = train_dp(MODEL.build(), SOURCE.load([0, 1]), config, SECURE.source("dpsgd"))

    assert group.secure and [c.epoch for c in checkpoints] == [1, 2, 3] and all(c.secure for c in checkpoints)
    assert checkpoints[-1].sample_rate == central.sample_rate == pytest.approx(0.1)
    assert checkpoints[-1].steps == central.steps == 30
    for checkpoint in checkpoints:  # the ε reported is the secure sum's own accounting, not the Gaussian's
        expected = dp_step_charge(0.1, 0.7, checkpoint.steps, "", secure=True)
        assert checkpoint.epsilon == pytest.approx(epsilon_from_rdp(expected.orders, expected.rdp, 1e-5)[0])
        np.testing.assert_allclose(checkpoint.charge().rdp, expected.rdp)
    # Skellam noise through the general subsampling bound costs somewhat more than the Gaussian
    assert central.epsilon < checkpoints[-1].epsilon < 1.6 * central.epsilon
    # the checkpoint is a usable model that learned, measured here on the public test split
    # (no statistic of the private data comes out of the actors)
    model = checkpoints[-1].load_into(MODEL.build())
    assert predict_logits(model, SOURCE.load([0]).x[:5]).shape == (5, 10)
    assert public_test_loss(model) < public_test_loss(MODEL.build()) - 0.3  # 2.31 → about 1.5 in trials


def public_test_loss(model) -> float:
    test = load_digits()[1]
    logits = torch.from_numpy(predict_logits(model, test.x))
    return float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(test.y)))


def test_one_actor_trains_alone_on_the_declared_schedule_and_checkpoints_every_epoch(ray_session, actors):
    config = DPSGDConfig(epochs=2, batch_size=60, lr=0.5, noise_multiplier=1.1)
    # it holds shard 0 (about 300 records); the schedule is the declared 600's, whatever it holds
    checkpoints = ray_session.get(actors[0].train_dp.remote(config, SECURE, 600))
    assert [c.epoch for c in checkpoints] == [1, 2]
    assert 0 < checkpoints[0].epsilon < checkpoints[1].epsilon
    assert checkpoints[1].steps == 2 * checkpoints[0].steps == 20
    assert checkpoints[1].sample_rate == pytest.approx(0.1)
    with pytest.raises(ValueError, match="shard ids"):
        SOURCE.load([2])
