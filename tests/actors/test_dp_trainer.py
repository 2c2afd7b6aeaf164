"""Shard actors and data-parallel DP-SGD: private sums leave the actors only as DP releases or masked shares."""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from conclave.actors.dp_trainer import ModelSpec, PrivateSource, ShardGroup, ShardPlan, ShardSupport
from conclave.learning.dp_schedule import DPSGDConfig
from conclave.learning.dpsgd import train_dp
from conclave.learning.embedding_stats import covariance_sum, support_counts
from conclave.learning.data import load_digits
from conclave.learning.data.schema import Standardiser
from conclave.learning.data.sources import DataSource
from conclave.learning.selection.entropy import logit_entropy
from conclave.learning.training import embed, predict_logits
from conclave.privacy.accounting.filter import filter_for
from conclave.privacy.accounting.ledger import BudgetExceeded, PrivacyLedger
from conclave.privacy.counts import LaplaceCounts, SkellamCounts
from conclave.privacy.noise import SECURE, NoisePolicy
from conclave.privacy.pca import AnalyzeGauss, SecureAnalyzeGauss, upper_triangle
from conclave.privacy.secure_release import summed_shares
from conclave.privacy.secure_sum import decode_integers, skellam_noise

SOURCE = PrivateSource("digits", None, private_size=600, num_shards=2, seed=0)
MODEL = ModelSpec("digits_cnn", num_classes=10)


@pytest.fixture(scope="module")
def group(ray_session):
    with ShardGroup([ShardPlan(SOURCE, (0,)), ShardPlan(SOURCE, (1,))], MODEL, num_cpus=0.5) as group:
        yield group


@pytest.fixture(scope="module")
def actors(group):
    return group.actors


def test_private_sums_are_computed_inside_the_actors_and_equal_the_central_ones(ray_session, group):
    actors, owners = group.actors, group.owners
    state = {k: v.numpy() for k, v in MODEL.build().state_dict().items()}
    ray_session.get([a.set_weights.remote(state) for a in actors])

    union = SOURCE.load([0, 1])  # the central computation, for comparison only
    model = MODEL.build()
    embeddings = embed(model, union.x)
    entropy = logit_entropy(predict_logits(model, union.x))
    d = embeddings.shape[1]
    assert ray_session.get(actors[0].embedding_dimension.remote()) == d
    policy = NoisePolicy(insecure_seed=5)  # replayable, so that the test can take each actor's noise share out

    def shares(method, mechanism, plan, session, *args):
        keys = tuple(ray_session.get([a.mask_key.remote(rank) for rank, a in enumerate(actors)]))
        return ray_session.get([getattr(a, method).remote(mechanism, plan, owners, keys, session, policy, *args)
                                for a in actors])

    def noise_shares(plan, session):
        variances = plan.party_variances(owners)
        return sum(skellam_noise(plan.dimension, variances[rank], policy.source(f"{session}-{rank}"))
                   for rank in range(len(actors)))

    # What leaves each actor is a masked share, uniform on the ring; only their sum decodes,
    # to the central covariance sum (up to each actor's rounding) plus the noise shares.
    pca = SecureAnalyzeGauss(1.0, 1e-5)
    plan = pca.plan(d, owners, 600)
    covariance_shares = shares("covariance_share", pca, plan, "pca-test")
    for share in covariance_shares:
        assert share.shape == (d * (d + 1) // 2,) and share.min() >= 0 and share.max() < plan.modulus
        assert stats.kstest(share / plan.modulus, "uniform").pvalue > 1e-4
    total = decode_integers(summed_shares(covariance_shares, plan), plan)
    clean = (total - noise_shares(plan, "pca-test")) / plan.scale
    np.testing.assert_allclose(clean, upper_triangle(covariance_sum(embeddings)), rtol=0, atol=1.0 / plan.scale + 1e-3)

    rng = np.random.default_rng(0)
    projection = np.linalg.qr(rng.normal(size=(d, 4)))[0]
    public_points = rng.normal(size=(30, 4)) * 0.3
    threshold = float(np.median(entropy))
    counts = SkellamCounts(0.5, 1e-5)
    plan = counts.plan(30, owners, 600)
    count_shares = shares("counts_share", counts, plan, "counts-test", projection, public_points, threshold)
    assert all(c.shape == (30,) and c.dtype == np.int64 and c.max() < plan.modulus for c in count_shares)
    central = support_counts(embeddings, entropy, projection, public_points, threshold)
    assert central.sum() == np.sum(entropy >= threshold)  # each voter counted once
    np.testing.assert_array_equal(counts.release(count_shares, plan) - noise_shares(plan, "counts-test"), central)
    with pytest.raises(RuntimeError, match="fresh mask key"):  # a key pair serves one sum only
        ray_session.get(actors[0].counts_share.remote(counts, plan, owners, (b"",) * 2, "again", policy,
                                                      projection, public_points, threshold))

    # Through ShardSupport: charged to a real ledger once every share arrived, with the secure
    # mechanisms' own curves.
    ledger = PrivacyLedger(":memory:", 1e-5)
    support = group.support(pca, counts, ledger, SECURE, records=600)
    released = support.dp_projection(4)
    noisy = support.noisy_support(released, public_points, threshold)
    assert released.shape == (d, 4) and noisy.shape == (30,) and noisy.dtype == np.int64
    spent = ledger.report().by_label
    assert sorted(spent) == ["dp-pca", "noisy-counts"] and ledger.report().charges == 2
    np.testing.assert_allclose(ledger.spent().rdp, pca.charge().rdp + counts.charge().rdp)
    with pytest.raises(ValueError, match="charged for another mechanism"):
        group.support(AnalyzeGauss(1.0, 1e-5), LaplaceCounts(0.5), ledger, SECURE, records=600)
    # A budget that cannot afford the release refuses it before any share is made.
    tight = PrivacyLedger(":memory:", 1e-5, filter_for(counts.charge(), 0.9 * _epsilon_of(counts.charge()), 1e-5))
    with pytest.raises(BudgetExceeded):
        group.support(pca, counts, tight, SECURE, records=600).noisy_support(released, public_points, threshold)
    assert tight.report().charges == 0

    # One actor holding all the data noises its own sums (Gaussian, discrete Laplace); nothing else leaves it.
    alone_ledger = PrivacyLedger(":memory:", 1e-5)
    alone = ShardSupport(actors[:1], owners[:1], AnalyzeGauss(1.0, 1e-5), LaplaceCounts(0.5), alone_ledger,
                         SECURE, records=600)
    assert alone.dp_projection(4).shape == (d, 4)
    assert alone.noisy_support(released, public_points, threshold).shape == (30,)
    assert sorted(alone_ledger.report().by_label) == ["dp-pca", "noisy-counts"]
    with pytest.raises(ValueError, match="charged for another mechanism"):
        ShardSupport(actors[:1], owners[:1], pca, counts, alone_ledger, SECURE, records=600)


def _epsilon_of(charge) -> float:
    from conclave.privacy.accounting.rdp import epsilon_from_rdp

    return epsilon_from_rdp(charge.orders, charge.rdp, 1e-5)[0]


def test_data_parallel_dpsgd_on_two_actors_sums_securely_is_charged_as_skellam_and_learns(group):
    from conclave.learning.dp_schedule import dp_step_charge
    from conclave.privacy.accounting.rdp import epsilon_from_rdp

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


def test_an_owner_dropping_out_stops_training_in_one_line_and_a_release_leaves_nothing_released_or_charged(
        ray_session, group):
    """A rank's actor killed mid-training: the round cannot complete, the group says whose; a
    release prepared while it lived then releases and charges nothing, and NearPrivate's weights
    cannot be loaded. Last of the module's ``group`` tests: it kills one of its actors."""
    from conclave.actors.owners import OwnerDropout

    state = {k: v.numpy() for k, v in MODEL.build().state_dict().items()}
    group.load_weights(state, records=600)
    ledger = PrivacyLedger(":memory:", 1e-5)
    support = group.support(SecureAnalyzeGauss(1.0, 1e-5), SkellamCounts(0.5, 1e-5), ledger, SECURE, records=600)
    config = DPSGDConfig(epochs=200, batch_size=60, lr=0.1, noise_multiplier=1.0)
    threading.Thread(target=lambda: (after_an_epoch(ray_session, group.actors[1]),
                                     ray_session.kill(group.actors[1], no_restart=True))).start()
    with pytest.raises(OwnerDropout, match=r"^owner digits \(private split\) dropped out of the secure sum"):
        group.train(config, SECURE, num_examples=600)
    expected = f"owner {group.owners[1]} dropped out of the secure sum of dp-pca"
    with pytest.raises(OwnerDropout, match=re.escape(expected)):
        support.dp_projection(4)
    assert ledger.report().charges == 0
    with pytest.raises(OwnerDropout, match=re.escape(f"owner {group.owners[1]} dropped out of NearPrivate's "
                                                     "selection (its actor died): nothing was charged")):
        group.load_weights(state, records=600)


def after_an_epoch(ray_session, actor) -> None:
    """Returns once ``actor`` counts more epochs than when asked first: mid-way through the training
    about to start (a long one; the count a previous training left is reset when it starts)."""
    first = ray_session.get(actor.epochs_done.remote())
    while ray_session.get(actor.epochs_done.remote()) <= first:
        time.sleep(0.1)


# ---- a stopped owner: every secure round has a deadline from public figures (issue 36, item 3) ----

HOSPITALS = Path(__file__).resolve().parents[2] / "examples" / "hospitals" / "data"
CLASSES = ("benign", "malignant")


@dataclass(frozen=True)
class HospitalTable:
    """One hospital's table as a shard actor's source (a ``ShardSource``): its name tells its rank apart."""

    owner: str

    def load(self, shard_ids):
        return DataSource("csv", str(HOSPITALS / self.owner / "records.csv"), label="diagnosis").read(CLASSES)


@pytest.fixture(scope="module")
def hospitals(ray_session):
    """Two shard actors with tables of their own (their names tell their ranks apart), one each;
    every test resumes the actors it stops."""
    public = DataSource("csv", str(HOSPITALS / "public" / "test.csv"), label="diagnosis").read(CLASSES)
    spec = ModelSpec("logistic_regression", 2, input_shape=(30,), standardiser=Standardiser.of_public(public))
    plans = [ShardPlan(HospitalTable(name), (0,)) for name in ("hospital_a", "hospital_b")]
    with ShardGroup(plans, spec, num_cpus=0.5) as pair:
        yield pair


@contextmanager
def stoppable(ray_session, actor):
    """``stop()`` sends SIGSTOP to the actor's process (a hung owner: alive, silent); always resumed after."""
    pid = ray_session.get(actor.__ray_call__.remote(lambda holder: os.getpid()))
    try:
        yield lambda: os.kill(pid, signal.SIGSTOP)
    finally:
        os.kill(pid, signal.SIGCONT)


class StoppingLedger:
    """A real ledger whose charge stops an owner first: the keys are in, the shares not yet asked."""

    def __init__(self, ledger: PrivacyLedger, stop) -> None:
        self.ledger, self.stop = ledger, stop

    def can_afford(self, charge) -> bool:
        return self.ledger.can_afford(charge)

    def charge(self, charge):
        self.stop()
        return self.ledger.charge(charge)


def test_a_stopped_owner_fails_a_secure_release_in_one_line_within_its_deadline(ray_session, hospitals, monkeypatch):
    from conclave.actors.owners import OwnerDropout

    state = {k: v.numpy() for k, v in hospitals_model(hospitals).state_dict().items()}
    # A stopped owner cannot hold NearPrivate up while it loads the checkpoint: one line, at the deadline.
    with stoppable(ray_session, hospitals.actors[1]) as stop:
        monkeypatch.setattr(hospitals, "share_base_s", 2.0)
        stop()
        started = time.monotonic()
        with pytest.raises(OwnerDropout, match="^owner hospital_b sent no acknowledgement of the checkpoint's "
                                               "weights for NearPrivate's selection within 3 s: nothing was charged$"):
            hospitals.load_weights(state, records=100)  # 2 s, and 0.01 s for each declared record
        assert 3.0 <= time.monotonic() - started < 20
    monkeypatch.undo()
    hospitals.load_weights(state, records=100)
    cancelled = []
    cancel = ray_session.cancel
    monkeypatch.setattr(ray_session, "cancel", lambda ref, **kwargs: (cancelled.append(ref), cancel(ref, **kwargs)))
    releases = (SecureAnalyzeGauss(1.0, 1e-5), SkellamCounts(0.5, 1e-5))

    # No key within the key deadline: nothing asked, nothing charged.
    ledger = PrivacyLedger(":memory:", 1e-5)
    with stoppable(ray_session, hospitals.actors[1]) as stop:
        support = hospitals.support(*releases, ledger, SECURE, records=200)
        support.key_timeout_s = 2.0
        stop()
        started = time.monotonic()
        with pytest.raises(OwnerDropout) as refused:
            support.dp_projection(4)
        took = time.monotonic() - started
    assert str(refused.value) == ("owner hospital_b sent no key for the secure sum of dp-pca within 2 s: no share "
                                  "was asked for, so nothing was released or charged")
    assert 2.0 <= took < 20 and ledger.report().charges == 0 and len(cancelled) == 1  # 2 s, not the default 30 s

    # Keys in, then the owner stops: its share is asked for, so the release is charged, and the
    # late call is cancelled. The deadline is the declared records' work (200 · 30² multiply-adds).
    ledger = PrivacyLedger(":memory:", 1e-5)
    with stoppable(ray_session, hospitals.actors[1]) as stop:
        support = hospitals.support(*releases, StoppingLedger(ledger, stop), SECURE, records=200)
        support.key_timeout_s, support.share_base_s = 2.0, 2.0
        assert support.share_timeout_s(30 * 30) == pytest.approx(2.0018)
        started = time.monotonic()
        with pytest.raises(OwnerDropout) as refused:
            support.dp_projection(4)
        took = time.monotonic() - started
    assert str(refused.value) == ("owner hospital_b sent no share for the secure sum of dp-pca within 2.0018 s: its "
                                  "shares were asked for, so it was charged; nothing of it was released")
    assert 2.0 <= took < 20 and ledger.report().charges == 1 and len(cancelled) == 2
    # the owner back, the next release runs (fresh keys) and is charged
    monkeypatch.undo()
    support = hospitals.support(*releases, ledger, SECURE, records=200)
    assert support.dp_projection(4).shape == (30, 4) and ledger.report().charges == 2


def hospitals_model(group: ShardGroup):
    from conclave.learning.models import build_model

    public = DataSource("csv", str(HOSPITALS / "public" / "test.csv"), label="diagnosis").read(CLASSES)
    return build_model("logistic_regression", 2, input_shape=group.input_shape,
                       standardiser=Standardiser.of_public(public))


def test_a_stopped_owner_fails_secure_dpsgd_in_one_line_within_the_deadlines(ray_session, hospitals, monkeypatch):
    from conclave.actors.owners import OwnerDropout

    monkeypatch.setattr(hospitals, "key_timeout_s", 2.0)
    monkeypatch.setattr(hospitals, "step_timeout_s", 5.0)
    config = DPSGDConfig(epochs=500, batch_size=20, lr=0.1, noise_multiplier=1.0)
    # Stopped before training: its key is not in within the key deadline; nothing starts.
    with stoppable(ray_session, hospitals.actors[1]) as stop:
        stop()
        started = time.monotonic()
        with pytest.raises(OwnerDropout) as refused:
            hospitals.train(config, SECURE, num_examples=200)
        assert time.monotonic() - started < 20  # the 2 s key deadline, not the default 30 s (room for a loaded machine)
    assert str(refused.value) == ("owner hospital_b sent no key for the secure sum of DP-SGD within 2 s: nothing "
                                  "was trained or released")
    # Stopped while training: the other rank's all-reduce times out (the step deadline), and the
    # owner that does not answer is named.
    with stoppable(ray_session, hospitals.actors[1]) as stop:
        stopped = []
        threading.Thread(target=lambda: (after_an_epoch(ray_session, hospitals.actors[1]), stop(),
                                         stopped.append(time.monotonic()))).start()
        with pytest.raises(OwnerDropout) as refused:
            hospitals.train(config, SECURE, num_examples=200, progress=True)
        took = time.monotonic() - stopped[0]
    assert str(refused.value) == ("owner hospital_b sent no answer for the secure sum of DP-SGD within 2 s: the "
                                  "run stops and releases nothing of the unfinished round")
    # from the stop, the step deadline (the 2 s may overlap the step the stop cut short)
    assert 5 <= took < 5 + 2 + 40  # far below the default step deadline (300 s)
