"""A vote source is one file and one registration (``cluster.teaching.VOTE_SOURCES``): the shipped
three are registered, a config chooses one by its section, and a toy one registered in a test
(``tests/toy_vote_source.py``) is chosen, checked and planned like them. The run's mechanism is one
object, read by plans and reports; an aggregator answers with its own copy."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conclave.cluster.api import TeacherStudent
from conclave.cluster.plan_command import make_plan
from conclave.cluster.run_privacy import CLUSTER_AGGREGATOR, KNN_AGGREGATOR, TRUSTED_AGGREGATOR
from conclave.cluster.teaching import VOTE_SOURCES, VoteSource, register
from conclave.cluster.teaching.clusters import ClustersSource
from conclave.cluster.teaching.config import (ClustersConfig, KnnConfig, MechanismConfig, PrivacyConfig,
                                              TeacherStudentConfig)
from conclave.cluster.teaching.knn import KnnSource
from conclave.cluster.teaching.teachers import TeachersSource
from conclave.learning.data.dataset import SHARD_LEMMA
from conclave.privacy.mechanisms.private_knn import KNN_LEMMA
from conclave.privacy.mechanisms.public_clusters import CLUSTER_LEMMA
from tests.toy_vote_source import TOY_LEMMA, ToyConfig, ToySource, ToyVotes

KNN_MECHANISM = MechanismConfig("private-knn", {"sigma1": 15.0, "threshold": 20.0, "sigma2": 8.0})
CLUSTER_MECHANISM = MechanismConfig("public-clusters", {"sigma": 4.0})


@pytest.fixture
def toy():
    register(ToySource)
    yield ToySource
    del VOTE_SOURCES[ToySource.kind]


def test_the_registry_lists_the_three_shipped_sources_and_a_config_chooses_by_its_section():
    assert VOTE_SOURCES == {"teachers": TeachersSource, "knn": KnnSource, "clusters": ClustersSource}
    teachers = TeacherStudentConfig()
    knn = TeacherStudentConfig(knn=KnnConfig(k=30), mechanism=KNN_MECHANISM)
    clusters = TeacherStudentConfig(clusters=ClustersConfig(count=40), mechanism=CLUSTER_MECHANISM)
    assert isinstance(teachers.vote_source, TeachersSource) and teachers.vote_source.section is teachers.teachers
    assert isinstance(knn.vote_source, KnnSource) and knn.vote_source.section is knn.knn
    assert isinstance(clusters.vote_source, ClustersSource) and clusters.vote_source.section is clusters.clusters
    assert [c.vote_lemma for c in (teachers, knn, clusters)] == [SHARD_LEMMA, KNN_LEMMA, CLUSTER_LEMMA]
    assert [c.vote_source.trust for c in (teachers, knn, clusters)] == [TRUSTED_AGGREGATOR, KNN_AGGREGATOR,
                                                                         CLUSTER_AGGREGATOR]
    assert knn.mechanism.params["sample_rate"] == knn.knn.sample_rate  # what the source pairs the mechanism with
    assert clusters.student.queries == 40  # the medoids, asked in one batch
    with pytest.raises(ValueError, match="^choose one vote source: knn or clusters$"):
        TeacherStudentConfig(knn=KnnConfig(), clusters=ClustersConfig(), mechanism=KNN_MECHANISM)


def test_a_source_that_does_not_describe_itself_is_refused():
    class Nameless(ToySource):
        kind = ""

    class Borrowed(ToySource):
        kind = "knn"

    class Unfinished(VoteSource[TeacherStudentConfig]):
        kind = "unfinished"

    with pytest.raises(TypeError, match="Nameless cannot be registered: it has no kind"):
        register(Nameless)
    with pytest.raises(TypeError, match="the kind 'knn' is KnnSource's"):
        register(Borrowed)
    with pytest.raises(TypeError, match="it is not a subclass"):
        register(dict)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Unfinished cannot be registered: it does not implement check_gateway, "
                                        "described, gateway_terms, serving, start, votes_per_query, work$"):
        register(Unfinished)
    assert sorted(VOTE_SOURCES) == ["clusters", "knn", "teachers"]


def test_a_toy_source_registered_in_a_test_is_chosen_checked_and_planned(toy, tmp_path):
    config = ToyConfig(toy=ToyVotes(copies=3), teachers=dataclasses.replace(TeacherStudentConfig().teachers, count=10),
                       mechanism=MechanismConfig("gnmax", {"sigma": 20.0}), privacy=PrivacyConfig(budget=None))
    assert isinstance(config.vote_source, ToySource) and config.vote_lemma == TOY_LEMMA
    # what the mechanism left to the votes per query is filled from the toy's count
    scaled = ToyConfig(toy=ToyVotes(copies=3), teachers=config.teachers)
    assert scaled.mechanism.params["threshold"] == pytest.approx(TeacherStudentConfig(
        teachers=dataclasses.replace(config.teachers, count=30)).mechanism.params["threshold"])
    with pytest.raises(ValueError, match=r"^toy\.copies \(11\) exceeds the teachers \(10\)$"):
        dataclasses.replace(config, toy=ToyVotes(copies=11))
    with pytest.raises(ValueError, match="^choose one vote source: knn or clusters or toy$"):
        dataclasses.replace(config, knn=KnnConfig())
    plan = make_plan(str(tmp_path / "toy.yaml"), TeacherStudent(config))
    assert plan.work == "gnmax (sigma 20) on 300 queries; toy votes, 3 per teacher"
    assert plan.counts.teachers == 10


def test_the_run_has_one_mechanism_object_and_its_aggregator_answers_with_its_own_copy():
    config = TeacherStudentConfig(mechanism=MechanismConfig("stability", {"epsilon": 2.0, "delta": 1e-6,
                                                                         "max_unstable": 5}))
    mechanism = config.vote_mechanism
    assert mechanism is config.mechanism.instance and config.vote_mechanism is mechanism
    resolved = dataclasses.replace(config, student=dataclasses.replace(config.student, queries=20))
    assert resolved.vote_mechanism is mechanism  # a step that re-resolves the config keeps the object
    planned = config.planned()
    answering = config.answering_mechanism()
    assert answering == mechanism and answering is not mechanism
    votes = np.tile([40, 5, 5], (3, 1))
    answering(votes, np.random.default_rng(0)).commit()  # the ledger accepted: its run opened
    assert answering.opened and not mechanism.opened
    assert config.planned().rdp.tolist() == planned.rdp.tolist()  # the plan still prices the whole run
