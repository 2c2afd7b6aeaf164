"""The student: asks a real gRPC aggregator, trains on answered labels only, stops when refused."""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest

from conclave.actors.aggregator import AggregatorServer, ServerSettings
from conclave.actors.student import Student, StudentActor
from conclave.actors.teacher import TeacherGroup, TeacherSource
from conclave.cluster.client import AggregatorClient
from conclave.learning.data import Dataset, make_splits
from conclave.learning.label_propagation import LabelPropagationConfig
from conclave.learning.selection import QuerySelection
from conclave.learning.selection.cold_start import kmeans_cold_start
from conclave.learning.semi_supervised import FixMatchConfig
from conclave.learning.student_training import StudentTrainer
from conclave.learning.train_config import TrainConfig
from conclave.privacy.accounting.filter import RenyiFilter
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.accounting.rdp import epsilon_from_rdp
from conclave.privacy.mechanisms import build_mechanism

TOKEN = "student-test-token"
STUDENT_TRAIN = TrainConfig(epochs=25, batch_size=32, lr=3e-3, seed=0)


def a_student(public: Dataset, test: Dataset, model: str, train: TrainConfig, factory, num_threads: int | None = None,
              selection: QuerySelection = QuerySelection(), cluster_embedding=None, **training) -> Student:
    """A ``Student`` of ``public`` whose ``StudentTrainer`` has these settings."""
    return Student(public, StudentTrainer(public, test, model, train, **training), factory, num_threads, selection,
                   cluster_embedding)


class RecordingClient(AggregatorClient):
    """The real client, keeping the size of every batch it sends and every reply it gets."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[int] = []
        self.replies: list = []

    def label_reply(self, inputs: np.ndarray):
        self.sent.append(len(inputs))
        reply = super().label_reply(inputs)
        self.replies.append(reply)
        return reply


def recording(client_class: type[RecordingClient], address: str) -> tuple:
    """A client factory for a student, and the list of the clients it built."""
    clients: list[RecordingClient] = []

    def build() -> RecordingClient:
        clients.append(client_class(address, TOKEN))
        return clients[-1]

    return build, clients


@pytest.fixture(scope="module")
def world():
    """Digits splits and five trained teachers (in-process: the student cannot tell)."""
    splits = make_splits("digits", public_size=200, seed=1).student_side()
    teachers = TeacherGroup(TeacherSource("digits", None, public_size=200, num_teachers=5, seed=1), 0, 5,
                            "digits_cnn", TrainConfig(epochs=10, batch_size=32, lr=3e-3, seed=1))
    teachers.train_all()
    return splits, teachers


@pytest.fixture
def serve(world, tmp_path):
    """Start an aggregator on 127.0.0.1 (ephemeral port) with the given mechanism and limit."""
    _, teachers = world
    servers = []

    def start(mechanism, budget: RenyiFilter | None = None):
        ledger = PrivacyLedger(tmp_path / f"ledger{len(servers)}.sqlite", 1e-5, budget)
        server = AggregatorServer(teachers, mechanism, ledger, (1, 8, 8),
                                  ServerSettings(host="127.0.0.1", port=0, token=TOKEN))
        address = server.start()
        servers.append((server, ledger))
        return server, ledger, functools.partial(AggregatorClient, address, TOKEN)

    yield start
    for server, ledger in servers:
        server.stop()
        ledger.close()


def test_student_actor_learns_from_answers_over_grpc(ray_session, world, serve):
    splits, _ = world
    server, ledger, factory = serve(build_mechanism("gnmax", sigma=1.0))
    student = StudentActor.remote(splits.public, StudentTrainer(splits.public, splits.test, "digits_cnn", STUDENT_TRAIN),
                                  factory)
    queried = ray_session.get(student.query.remote(150, 40, (40, 100), False))
    assert queried["asked"] == 150 and queried["answered"] == 150  # GNMax always answers
    assert not queried["budget_exhausted"]
    assert queried["label_accuracy"] > 0.8
    # Checkpoints at 40, 100 and the end, each with the budget read after it; ε only grows.
    assert [c["asked"] for c in queried["checkpoints"]] == [40, 100, 150]
    spent = [c["budget"]["epsilon_spent"] for c in queried["checkpoints"]]
    assert spent[0] < spent[1] < spent[2] == pytest.approx(ledger.report().epsilon_spent)
    assert queried["checkpoints"][-1]["budget"]["queries_answered"] == 150
    curve = ray_session.get(student.learning_curve.remote())
    assert [p["answered"] for p in curve] == [40, 100, 150]
    assert curve[-1]["accuracy"] > 0.6  # chance is 0.1
    votes, answered = server.answered_votes()
    assert votes.shape == (150, 10) and answered.all()


def test_student_trains_only_on_answered_labels(world, serve):
    """A threshold no histogram of 5 teachers can pass: everything abstains, nothing to learn."""
    splits, _ = world
    _, _, factory = serve(build_mechanism("confident-gnmax", threshold=1000.0, sigma1=1.0, sigma2=1.0))
    student = a_student(splits.public, splits.test, "digits_cnn", STUDENT_TRAIN, factory)
    queried = student.query(60, 30, progress=False)
    assert queried["asked"] == 60 and queried["answered"] == 0
    assert (student.labels[:60] == -1).all()
    assert math.isnan(queried["label_accuracy"])
    result = student.fit_and_evaluate()
    assert result["answered"] == 0 and math.isnan(result["accuracy"])


def test_a_student_on_features_asks_about_images_and_learns_on_their_features(world, serve):
    splits, _ = world
    _, _, factory = serve(build_mechanism("gnmax", sigma=1.0))  # validates (1, 8, 8) images
    student = a_student(splits.public, splits.test, "scatternet_cnn", STUDENT_TRAIN, factory, features="scattering")
    assert student.query(150, 50, progress=False)["answered"] == 150
    student.close()
    assert student.trainer.test.input_shape == (81, 2, 2)
    assert student.fit_and_evaluate()["accuracy"] > 0.6  # chance is 0.1


def test_a_student_with_test_views_reports_the_accuracy_of_its_view_averaged_predictions(world, serve):
    """Its reported accuracy is that of ``predict_with_views`` on the images (their features made
    after the shift), from the same trained model."""
    from conclave.learning.data.features import batch_transform
    from conclave.learning.view_averaging import predict_with_views

    splits, _ = world
    _, _, factory = serve(build_mechanism("gnmax", sigma=1.0))
    student = a_student(splits.public, splits.test, "scatternet_cnn", STUDENT_TRAIN, factory, features="scattering",
                      test_views=4)
    student.query(150, 50, progress=False)
    student.close()
    result = student.fit_and_evaluate()
    model = student._last_model
    predicted = predict_with_views(model, splits.test.x, batch_transform("scattering", (8, 8)), 4, STUDENT_TRAIN.seed)
    assert result["accuracy"] == pytest.approx(float(np.mean(predicted == splits.test.y)))
    assert result["accuracy"] > 0.6  # chance is 0.1


def test_test_views_are_refused_for_table_inputs(world):
    splits, _ = world
    table = Dataset(splits.test.x.reshape(len(splits.test), -1), splits.test.y, 10, "table")
    with pytest.raises(ValueError, match="test_views"):
        a_student(table, table, "logistic_regression", STUDENT_TRAIN, lambda: None, test_views=2)


def test_self_training_labels_the_rest_of_the_pool_with_the_students_own_guesses(world, serve):
    splits, _ = world
    _, ledger, factory = serve(build_mechanism("gnmax", sigma=1.0))
    # The pool's true labels are replaced by zeros: were they ever used for training, the
    # student would learn "always 0" (10% test accuracy).
    blind = Dataset(splits.public.x, np.zeros(len(splits.public), dtype=np.int64), 10, "blind-pool")
    student = a_student(blind, splits.test, "digits_cnn", STUDENT_TRAIN, factory, pseudo_label_threshold=0.9)
    student.query(60, 30, progress=False)
    student.close()
    spent = ledger.report().epsilon_spent
    result = student.fit_and_evaluate()
    assert result["answered"] == 60 and 0 < result["pseudo_labelled"] <= len(blind) - 60
    assert result["accuracy"] > 0.6 and result["supervised_accuracy"] > 0.4  # chance is 0.1
    assert ledger.report().epsilon_spent == spent  # post-processing: nothing more was asked
    with pytest.raises(ValueError, match="pseudo_label_threshold"):
        a_student(blind, splits.test, "digits_cnn", STUDENT_TRAIN, factory, pseudo_label_threshold=1.5)


def room_for(answers: float) -> RenyiFilter:
    """A budget at order 16 with room for ``answers`` GNMax answers at σ = 2 (λ/σ² = 4 each)."""
    return RenyiFilter(epsilon_from_rdp([16.0], [answers * 4.0], 1e-5)[0], 1e-5, 16.0)


def test_student_asks_what_the_budget_pays_for_and_stops_without_a_refusal(world, serve):
    splits, _ = world
    budget = room_for(110.5)  # five batches of 20, a last one of 10: all the budget an answer can use
    server, ledger, _ = serve(build_mechanism("gnmax", sigma=2.0), budget)
    factory, clients = recording(RecordingClient, server.address)
    student = a_student(splits.public, splits.test, "digits_cnn", STUDENT_TRAIN, factory)
    queried = student.query(200, 20, progress=False)
    (client,) = clients
    assert client.sent == [20, 20, 20, 20, 20, 10]  # the tail in a smaller batch; then no call at 0
    assert not any(reply.refused.any() for reply in client.replies)  # nothing it sent was refused
    assert [reply.budget["affordable_queries"] for reply in client.replies] == [90, 70, 50, 30, 10, 0]
    assert queried["budget_exhausted"] and queried["asked"] == queried["answered"] == 110
    assert (student.labels[:110] >= 0).all() and (student.labels[110:] == -1).all()
    assert ledger.report().rdp_at_budget_order == pytest.approx(440.0)
    assert ledger.report().rdp_at_budget_order <= budget.rdp_budget
    assert queried["checkpoints"][-1]["budget"]["queries_answered"] == 110
    assert queried["checkpoints"][-1]["budget"]["affordable_queries"] == 0


@pytest.mark.parametrize("rival_spends, asked", [(15, 35), (30, 20)])
def test_a_budget_spent_by_another_client_meanwhile_ends_the_student_with_its_answers(world, serve,
                                                                                       rival_spends, asked):
    """Between the student's reading of the budget and its second call, another client spends
    part of it (that call is answered in part, the rest asked again and the student then stops at
    0) or all of it (that call is refused whole): the refusal handling is the fallback."""
    splits, _ = world
    server, _, _ = serve(build_mechanism("gnmax", sigma=2.0), room_for(50.5))
    rival = AggregatorClient(server.address, TOKEN)

    class Outpaced(RecordingClient):
        def label_reply(self, inputs: np.ndarray):
            if len(self.sent) == 1:  # the test split: inputs the student never asks
                rival.label(splits.test.x[:rival_spends])
            return super().label_reply(inputs)

    factory, clients = recording(Outpaced, server.address)
    student = a_student(splits.public, splits.test, "digits_cnn", STUDENT_TRAIN, factory)
    queried = student.query(200, 20, progress=False)
    rival.close()
    assert clients[0].sent == [20, 20]  # the budget paid for 30 more when the student read it
    assert queried["budget_exhausted"] and queried["asked"] == queried["answered"] == asked
    order = np.asarray(student.asked_order)
    assert len(np.unique(order)) == asked and (student.labels[order] >= 0).all()
    assert (student.labels[np.setdiff1d(np.arange(len(splits.public)), order)] == -1).all()
    assert len(server.answered_votes()[0]) == asked + rival_spends


def test_query_in_stretches_resumes_where_it_stopped(world, serve):
    splits, _ = world
    _, _, factory = serve(build_mechanism("gnmax", sigma=1.0))
    student = a_student(splits.public, splits.test, "digits_cnn", STUDENT_TRAIN, factory)
    progress = []
    while not progress or progress[-1] < 100:
        progress.append(student.query(100, 20, (50,), progress=False, max_batches=2)["asked"])
    student.close()
    assert progress == [40, 70, 100]  # the checkpoint at 50 splits a batch: 40→50, 50→70
    assert [c["asked"] for c in student.snapshots] == [50, 100]
    assert (student.labels[:100] >= 0).all() and (student.labels[100:] == -1).all()


def test_query_rejects_impossible_requests(world, serve):
    splits, _ = world
    _, _, factory = serve(build_mechanism("gnmax", sigma=1.0))
    student = a_student(splits.public, splits.test, "digits_cnn", STUDENT_TRAIN, factory)
    with pytest.raises(ValueError, match="pool size"):
        student.query(len(splits.public) + 1)
    with pytest.raises(ValueError, match="batch_size"):
        student.query(10, batch_size=0)



def test_the_semi_supervised_student_beats_the_supervised_one_on_the_same_answers(world, serve):
    splits, _ = world
    _, _, factory = serve(build_mechanism("gnmax", sigma=0.1))  # (nearly) the plurality: same labels every run
    supervised = a_student(splits.public, splits.test, "digits_cnn", STUDENT_TRAIN, factory)
    supervised.query(30, 30, progress=False)
    supervised.close()
    semi = a_student(splits.public, splits.test, "digits_cnn", STUDENT_TRAIN, factory,
                   semi_supervised=FixMatchConfig(epochs=60, batch_size=32, threshold=0.9))
    semi.labels, semi.asked_order = supervised.labels.copy(), list(supervised.asked_order)  # the same answers
    base, better = supervised.fit_and_evaluate(), semi.fit_and_evaluate()
    assert base["answered"] == better["answered"] == 30
    assert better["accuracy"] > base["accuracy"] + 0.08, (base["accuracy"], better["accuracy"])  # 62% → 78% when written


@pytest.mark.parametrize("strategy, cold_start", [("entropy", "random"), ("diverse_public", "random"),
                                                  ("entropy", "kmeans"), ("pool", "kmeans")])
def test_chosen_queries_are_pool_inputs_never_asked_twice(world, serve, strategy, cold_start):
    splits, _ = world
    server, _, factory = serve(build_mechanism("gnmax", sigma=1.0))
    student = a_student(splits.public, splits.test, "digits_cnn", dataclasses.replace(STUDENT_TRAIN, epochs=3),
                      factory, selection=QuerySelection(strategy=strategy, round_size=25, cold_start=cold_start))
    for _ in range(4):  # in stretches of three calls of 10: rounds of 25 and calls cross each other
        student.query(100, 10, progress=False, max_batches=3)
    student.close()
    asked = np.asarray(student.asked_order)
    if cold_start == "kmeans":  # the first round: the inputs nearest k-means centres of the whole pool
        first = kmeans_cold_start(splits.public.x, np.arange(len(splits.public)), 25, seed=0)
        assert (asked[:25] == first).all()
        if strategy == "pool":  # then the rest in pool order
            assert (asked[25:] == np.setdiff1d(np.arange(len(splits.public)), first)[:75]).all()
    assert len(asked) == 100 == len(np.unique(asked)) and asked.min() >= 0 and asked.max() < len(splits.public)
    votes, _ = server.answered_votes()
    assert len(votes) == 100  # the aggregator saw each chosen input once: no repeat, no cache hit
    assert (student.labels[np.setdiff1d(np.arange(len(splits.public)), asked)] == -1).all()
    with pytest.raises(ValueError, match="near_private"):
        QuerySelection(strategy="near_private")
    with pytest.raises(ValueError, match="cold_start"):
        QuerySelection(cold_start="centres")


def test_kmeans_cold_start_picks_distinct_inputs_nearest_the_centres():
    rng = np.random.default_rng(0)
    blobs = rng.normal(0, 10, (5, 8))  # 8 dimensions: the PCA keeps them all, distances unchanged
    points = np.concatenate([centre + rng.normal(0, 0.3, (30, 8)) for centre in blobs])
    member = np.arange(len(points)) // 30

    def nearest_mean(candidates: np.ndarray, blob: int) -> int:
        inside = candidates[member[candidates] == blob]
        centre = points[inside].mean(axis=0)  # k-means's centre of a blob it found
        return int(inside[np.argmin(((points[inside] - centre) ** 2).sum(axis=1))])

    everyone = np.arange(len(points))
    picked = kmeans_cold_start(points, everyone, 5, seed=0)
    assert sorted(picked) == sorted(nearest_mean(everyone, blob) for blob in range(5))
    # Never an input asked before: without those five, the nearest of the rest, one per blob.
    rest = np.setdiff1d(everyone, picked)
    again = kmeans_cold_start(points, rest, 5, seed=0)
    assert not set(again) & set(picked) and sorted(member[again]) == [0, 1, 2, 3, 4]
    assert sorted(again) == sorted(nearest_mean(rest, blob) for blob in range(5))
    # More centres than blobs: still distinct indices, every one a candidate.
    many = kmeans_cold_start(points, rest, len(rest), seed=0)
    assert sorted(many) == sorted(rest)
    with pytest.raises(ValueError, match="size"):
        kmeans_cold_start(points, rest, len(rest) + 1, seed=0)


def test_label_propagation_spreads_the_answers_over_the_pool_at_no_privacy_cost(world, serve):
    splits, _ = world
    _, ledger, factory = serve(build_mechanism("gnmax", sigma=0.1))  # (nearly) the plurality: same labels every run
    # The pool's true labels are zeros here: were they used for training, the student would learn "always 0".
    blind = Dataset(splits.public.x, np.zeros(len(splits.public), dtype=np.int64), 10, "blind-pool")
    supervised = a_student(blind, splits.test, "digits_cnn", STUDENT_TRAIN, factory)
    supervised.query(30, 30, progress=False)
    supervised.close()
    spent = ledger.report().epsilon_spent
    results = []
    for semi in (None, FixMatchConfig(epochs=60, batch_size=32, threshold=0.9)):
        student = a_student(blind, splits.test, "digits_cnn", STUDENT_TRAIN, factory, semi_supervised=semi,
                          label_propagation=LabelPropagationConfig())
        student.labels, student.asked_order = supervised.labels.copy(), list(supervised.asked_order)  # the same answers
        results.append(student.fit_and_evaluate())
    base, (spread, both) = supervised.fit_and_evaluate(), results
    assert spread["answered"] == both["answered"] == 30
    assert 0 < spread["propagated"] == both["propagated"] <= len(blind) - 30  # propagation is deterministic
    assert spread["accuracy"] > base["accuracy"] + 0.05, (base["accuracy"], spread["accuracy"])
    assert both["accuracy"] > 0.7  # chance is 0.1; 75% and 82% when written
    assert ledger.report().epsilon_spent == spent  # post-processing: nothing more was asked
    with pytest.raises(ValueError, match="pseudo_label_threshold.*label_propagation"):
        a_student(blind, splits.test, "digits_cnn", STUDENT_TRAIN, factory, pseudo_label_threshold=0.9,
                label_propagation=LabelPropagationConfig())


@pytest.mark.parametrize("semi_supervised", [None, FixMatchConfig(epochs=2, batch_size=16, views=1)])
def test_members_are_trained_from_consecutive_seeds_and_answer_with_their_mean_probabilities(world, semi_supervised):
    """``members``: member 0 is the single student (same seeds, same weights), the others differ,
    the averaged model's argmax is that of the members' mean softmax, and a later round embeds
    with the first member."""
    import torch

    from conclave.learning.models.averaged import AveragedStudents
    from conclave.learning.training import predict_logits

    splits, _ = world
    keep, labels = np.arange(60), splits.public.y[:60]
    train = dataclasses.replace(STUDENT_TRAIN, epochs=2)
    single = a_student(splits.public, splits.test, "digits_cnn", train, None, semi_supervised=semi_supervised)
    averaged = a_student(splits.public, splits.test, "digits_cnn", train, None, semi_supervised=semi_supervised,
                       members=3)
    alone, _ = single.trainer.train_on(keep, labels)
    model, _ = averaged.trainer.train_on(keep, labels)
    assert isinstance(model, AveragedStudents) and len(model.members) == 3
    weights = [torch.cat([p.flatten() for p in member.parameters()]) for member in model.members]
    assert torch.equal(weights[0], torch.cat([p.flatten() for p in alone.parameters()]))
    assert not torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], weights[2])
    x = splits.test.x
    mean = np.mean([torch.softmax(torch.from_numpy(predict_logits(m, x)), 1).numpy() for m in model.members], axis=0)
    assert (predict_logits(model, x).argmax(1) == mean.argmax(1)).all()
    averaged._last_model = model
    assert averaged.network().state.keys() == {k for k in model.first.state_dict()}
    with pytest.raises(ValueError, match="members must be >= 1"):
        a_student(splits.public, splits.test, "digits_cnn", train, None, members=0)
