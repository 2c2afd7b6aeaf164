"""kNN votes in the main job (the ``knn`` section): configs pair Private-kNN with kNN votes at one
sample rate, the aggregator refuses any other pairing, and runs go end to end — on the bundled
digits, and across three owners without the driver opening an owner's file."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from conclave.actors.labeller import PrivateLabeller
from conclave.cluster.config import load_yaml
from conclave.cluster.pipelines import load_pipeline
from conclave.cluster.teaching.config import TeacherStudentConfig, KnnConfig, MechanismConfig
from conclave.learning.data import make_splits
from conclave.learning.embeddings import NetworkEmbedding
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.mechanisms import PrivateKnnMechanism
from conclave.privacy.mechanisms.private_knn import KNN_LEMMA

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DIGITS_KNN = PROJECT_ROOT / "configs" / "digits-knn.yaml"
HOSPITALS_KNN = PROJECT_ROOT / "configs" / "hospitals-knn.yaml"
PRIVATE_KNN = MechanismConfig("private-knn", {"sigma1": 15.0, "threshold": 20.0, "sigma2": 8.0})


def test_private_knn_needs_knn_votes_and_takes_their_sample_rate():
    with pytest.raises(ValueError, match="add a knn section"):
        TeacherStudentConfig(mechanism=PRIVATE_KNN)
    config = TeacherStudentConfig(mechanism=PRIVATE_KNN, knn=KnnConfig(k=30, sample_rate=0.3))
    assert config.vote_mechanism == PrivateKnnMechanism(15.0, 20.0, 8.0, 0.3)
    mismatched = MechanismConfig("private-knn", {**PRIVATE_KNN.params, "sample_rate": 0.5})
    with pytest.raises(ValueError, match="sample_rate 0.5 but the vote source's is 0.3"):
        TeacherStudentConfig(mechanism=mismatched, knn=KnnConfig(k=30, sample_rate=0.3))
    # owner-local kNN votes summed securely: one noised total, so one σ
    with pytest.raises(ValueError, match="set sigma1 = sigma2"):
        TeacherStudentConfig(mechanism=PRIVATE_KNN, knn=KnnConfig(k=30, sample_rate=0.3), aggregation="secure")
    secure = MechanismConfig("private-knn", {"sigma1": 8.0, "threshold": 20.0, "sigma2": 8.0})
    secure_knn = TeacherStudentConfig(mechanism=secure, knn=KnnConfig(k=30, sample_rate=0.3), aggregation="secure")
    assert secure_knn.vote_mechanism.name == "secure-private-knn"
    with pytest.raises(ValueError, match="knn.embedding must be one of"):
        KnnConfig(embedding="sift")
    KnnConfig(embedding="network:results/mnist-knn/student.pt")  # an earlier round's student
    KnnConfig(embedding="my_encoders.mnist:encoder")  # a user's own, imported where it is fitted


def test_planned_charge_is_record_level_for_private_knn_and_restated_by_the_knn_lemma_for_gnmax():
    config = TeacherStudentConfig(mechanism=PRIVATE_KNN, knn=KnnConfig(k=30, sample_rate=0.3))
    planned = config.planned()
    direct = config.vote_mechanism.run_charge(config.student.queries, config.student.queries)
    assert planned.neighbouring == Neighbouring.ADD_REMOVE
    np.testing.assert_allclose(planned.rdp, direct.rdp, rtol=1e-12)
    # GNMax over kNN votes: one record moves one vote (the kNN lemma), no amplification claimed.
    gnmax = TeacherStudentConfig(mechanism=MechanismConfig("gnmax", {"sigma": 40.0}), knn=KnnConfig(k=30))
    assert gnmax.planned().details["neighbouring_lemma"] == KNN_LEMMA
    # Confident-GNMax's default threshold is a share of the k votes, not of teachers.
    assert TeacherStudentConfig(knn=KnnConfig(k=30)).vote_mechanism.threshold == pytest.approx(0.6 * 30)


def test_owners_declared_records_share_k_and_cap_nothing():
    """With kNN votes an owner's ``records`` is its declared count, which shares k among the owners
    (``actors.knn_votes.party_k``); nothing is cut to it (a cap would replace records)."""
    hospitals = load_pipeline(load_yaml(PROJECT_ROOT / "configs" / "hospitals.yaml")).config
    secure_knn = dataclasses.replace(hospitals, knn=KnnConfig(k=10, sample_rate=0.5, embedding="pca", dims=5),
                                     aggregation="secure",
                                     mechanism=MechanismConfig("private-knn", {"sigma1": 4.0, "threshold": 5.0,
                                                                               "sigma2": 4.0}))
    assert [owner.records for owner in secure_knn.owners] == [100, 100, 99]
    assert secure_knn.vote_mechanism.name == "secure-private-knn"


class _TeacherVotes:
    """A vote source that does not sample (as teachers' histograms)."""

    neighbouring, neighbouring_lemma = Neighbouring.ADD_REMOVE, "disjoint shards"
    votes_per_query, batch_coupled, num_classes, local = None, False, 3, False
    sample_rate = votes_per_record = None

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        return np.zeros((len(inputs), 3), dtype=np.int64)


class _SampledVotes(_TeacherVotes):
    sample_rate = 0.5


def test_the_aggregator_refuses_private_knn_over_votes_not_sampled_at_its_rate(tmp_path):
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite", 1e-5)
    mechanism = PrivateKnnMechanism(15.0, 20.0, 8.0, 0.3)
    with pytest.raises(ValueError, match="charged for votes with sample_rate 0.3; this vote source has sample_rate unset"):
        PrivateLabeller(_TeacherVotes(), mechanism, ledger)
    with pytest.raises(ValueError, match="this vote source has sample_rate 0.5"):
        PrivateLabeller(_SampledVotes(), mechanism, ledger)
    PrivateLabeller(_SampledVotes(), dataclasses.replace(mechanism, sample_rate=0.5), ledger)
    ledger.close()


def test_digits_knn_runs_end_to_end_within_its_declared_budget_then_a_round_on_its_students_network(
        ray_session, run_config_opening, tmp_path):
    run_config_opening(DIGITS_KNN)
    results = tmp_path / "digits-knn"
    privacy = json.loads((results / "privacy.json").read_text())
    metrics = json.loads((results / "metrics.json").read_text())
    assert privacy["guarantee"]["epsilon"] == 4.0 and privacy["sound"]
    assert privacy["mechanism"]["name"] == "private-knn" and privacy["mechanism"]["parameters"]["sample_rate"] == 0.3
    assert "squared distances" in privacy["trust_model"]["statement"]
    assert privacy["spent"]["epsilon"] <= 4.0 and privacy["estimates"] == []
    assert metrics["knn"]["k"] == 30 and metrics["knn"]["actors"] >= 1 and "teachers" not in metrics
    assert 0 < metrics["queries_answered"] <= metrics["queries_asked"] <= 300
    assert metrics["student_accuracy"] > 0.5

    # The student's network, trained on released labels and public inputs, embeds a second round.
    network = NetworkEmbedding.load(results / "student.pt")
    pool = make_splits("digits", None, public_size=300, seed=0).public.x[:5]
    assert network(pool).shape == (5, network(pool[:1]).shape[1])
    raw = load_yaml(DIGITS_KNN)
    # only its embedding and privacy are checked here: a short student
    raw["student"].update(train={**raw["student"]["train"], "epochs": 5},
                          semi_supervised={**raw["student"]["semi_supervised"], "epochs": 5})
    raw.update(name="digits-knn-round2", knn={**raw["knn"], "embedding": f"network:{results / 'student.pt'}"})
    second = tmp_path / "round2.yaml"
    second.write_text(yaml.safe_dump(raw))
    run_config_opening(second)
    metrics = json.loads((tmp_path / "digits-knn-round2" / "metrics.json").read_text())
    assert metrics["knn"]["embedding"].startswith("network:") and metrics["queries_answered"] > 0
    # round 2's embedding came from round 1's releases: it publishes the two composed
    second_privacy = json.loads((tmp_path / "digits-knn-round2" / "privacy.json").read_text())
    assert second_privacy["guarantee"]["basis"] == "composed"
    assert second_privacy["rounds"]["composed_with"] == ["digits-knn"]
    assert second_privacy["guarantee"]["epsilon"] > max(4.0, second_privacy["rounds"]["this_run"]["epsilon"]) - 1e-9


def test_three_owners_vote_by_knn_behind_their_gateways_and_meet_only_in_the_secure_sum(ray_session, run_config_opening,
                                                                                 tmp_path):
    opened = run_config_opening(HOSPITALS_KNN)
    raw = load_yaml(HOSPITALS_KNN)
    owner_files = {str((PROJECT_ROOT / owner["data"]["path"]).resolve()) for owner in raw["owners"]}
    assert not opened & owner_files
    metrics = json.loads((tmp_path / "hospitals-knn" / "metrics.json").read_text())
    assert set(metrics["knn"]["nodes"]) == {"hospital_a", "hospital_b", "hospital_c"}
    privacy = json.loads((tmp_path / "hospitals-knn" / "privacy.json").read_text())
    assert privacy["aggregation"] == "secure" and privacy["mechanism"]["name"] == "secure-private-knn"
    assert "no distance, neighbour or per-owner histogram" in privacy["trust_model"]["statement"]
    assert privacy["guarantee"]["epsilon"] <= 5.0 and privacy["spent"]["epsilon"] <= privacy["guarantee"]["epsilon"]
    assert metrics["queries_answered"] > 0


def test_owners_never_merge_clean_distances(tmp_path):
    """Owners' votes (kNN, public clusters, teachers) meet only in the secure sum: left out, it is the
    aggregation; a trusted aggregator is refused in one line."""
    raw = load_yaml(HOSPITALS_KNN)
    raw.pop("aggregation")
    assert load_pipeline(raw).config.secure
    raw["aggregation"] = "trusted-aggregator"
    with pytest.raises(ValueError, match="owners vote behind their gateways, in secure rounds"):
        load_pipeline(raw)
