"""Public-cluster votes in the main job (the ``clusters`` section): config rules, one release per
batch in the plan and the ledger, digits end to end on one node, and three hospitals whose votes
meet only in the secure sum."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from conclave.cluster.config import load_yaml
from conclave.cluster.pipelines import load_pipeline
from conclave.cluster.teaching.config import (ClustersConfig, KnnConfig, MechanismConfig, TeacherStudentConfig,
                                             TeacherStudentData)
from conclave.privacy.accounting.guarantee import worst_case_guarantee
from conclave.privacy.accounting.ledger import read_ledger
from conclave.privacy.accounting.pld import analytic_gaussian_epsilon
from conclave.privacy.accounting.report import planned_charge

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DIGITS = PROJECT_ROOT / "configs" / "demo.yaml"  # the demo: public-cluster votes on the digits
HOSPITALS = PROJECT_ROOT / "configs" / "hospitals-clusters.yaml"
CLUSTERS = MechanismConfig("public-clusters", {"sigma": 6.5})


def test_the_clusters_section_and_its_mechanism_go_together():
    with pytest.raises(ValueError, match="public-clusters is charged for votes with its votes_per_record: add a clusters"):
        TeacherStudentConfig(mechanism=CLUSTERS)
    with pytest.raises(ValueError, match="charged once per batch by mechanism public-clusters, not gnmax"):
        TeacherStudentConfig(clusters=ClustersConfig(), mechanism=MechanismConfig("gnmax", {"sigma": 5.0}))
    with pytest.raises(ValueError, match="choose one vote source"):
        TeacherStudentConfig(clusters=ClustersConfig(), knn=KnnConfig(), mechanism=CLUSTERS)
    with pytest.raises(ValueError, match=r"clusters.count \(2000\) exceeds server.max_batch"):
        TeacherStudentConfig(clusters=ClustersConfig(count=2000), mechanism=CLUSTERS,
                             data=TeacherStudentData(public_size=300))
    config = TeacherStudentConfig(clusters=ClustersConfig(count=60, votes_per_record=4), mechanism=CLUSTERS)
    assert config.mechanism.params["votes_per_record"] == 4  # filled from the section
    assert (config.student.queries, config.student.batch_size, config.student.selection.strategy) == (60, 60, "clusters")


def test_a_batch_of_medoids_is_planned_as_one_release_with_its_exact_gaussian_curve():
    config = load_pipeline(load_yaml(DIGITS)).config
    guarantee = config.privacy.guarantee(config.planned())
    assert guarantee.basis == "worst-case" and guarantee.neighbouring == "add-remove"
    assert guarantee.epsilon == pytest.approx(analytic_gaussian_epsilon(6.5 / math.sqrt(3), 1e-5))
    twice = planned_charge(config.vote_mechanism, 60, batch_size=30)  # two batches, two releases
    assert worst_case_guarantee(twice, 1e-5).epsilon == pytest.approx(analytic_gaussian_epsilon(6.5 / math.sqrt(6), 1e-5))


def test_several_owners_vote_for_clusters_only_through_the_secure_sum():
    raw = load_yaml(HOSPITALS)
    raw["aggregation"] = "trusted-aggregator"
    with pytest.raises(ValueError, match="owners vote behind their gateways, in secure rounds"):
        load_pipeline(raw)


@pytest.mark.slow
def test_digits_vote_for_the_medoids_once_and_the_clusters_are_labelled(ray_session, run_config_opening, tmp_path):
    raw = load_yaml(DIGITS)
    raw["student"]["members"] = 1  # the demo's release and student; one member where it averages three (suite time)
    first = tmp_path / "demo.yaml"
    first.write_text(yaml.safe_dump(raw))
    run_config_opening(first)
    results = tmp_path / "demo"
    privacy = json.loads((results / "privacy.json").read_text())
    metrics = json.loads((results / "metrics.json").read_text())
    assert privacy["guarantee"]["epsilon"] == pytest.approx(analytic_gaussian_epsilon(6.5 / math.sqrt(3), 1e-5))
    assert privacy["aggregation"] == "trusted-aggregator" and "one owner" in privacy["trust_model"]["statement"]
    assert metrics["clusters"]["count"] == 100 and metrics["queries_asked"] == 100
    (final,) = metrics["curve"]
    # the answered medoids label the pool images whose 7 nearest agree enough: more than they are, not all
    assert metrics["queries_answered"] < final["cluster_labelled"] < 300
    assert metrics["student_accuracy"] > 0.6
    snapshot = read_ledger(results / "ledger.sqlite")
    assert snapshot.charges == 1 and snapshot.answers == 100  # one release, a hundred labels on record

    # Round 2 clusters the pool in round 1's student network: new medoids, and the two releases compose.
    # only its privacy is checked here: a short student
    raw["student"].update(train={**raw["student"]["train"], "epochs": 5},
                          semi_supervised={**raw["student"]["semi_supervised"], "epochs": 5})
    raw.update(name="demo-round2", clusters={**raw["clusters"], "embedding": f"network:{results / 'student.pt'}"})
    second = tmp_path / "round2.yaml"
    second.write_text(yaml.safe_dump(raw))
    run_config_opening(second)
    privacy = json.loads((tmp_path / "demo-round2" / "privacy.json").read_text())
    assert privacy["rounds"]["composed_with"] == ["demo"] and privacy["guarantee"]["basis"] == "composed"
    # two fixed Gaussian releases compose exactly: one at σ/√2
    assert privacy["guarantee"]["epsilon"] == pytest.approx(analytic_gaussian_epsilon(6.5 / math.sqrt(6), 1e-5))


@pytest.mark.slow
def test_three_hospitals_vote_for_clusters_behind_their_gateways(ray_session, run_config_opening, tmp_path, monkeypatch):
    monkeypatch.setenv("CONCLAVE_HOME", str(tmp_path / "home"))
    opened = run_config_opening(HOSPITALS)
    raw = load_yaml(HOSPITALS)
    assert not opened & {str((PROJECT_ROOT / owner["data"]["path"]).resolve()) for owner in raw["owners"]}
    privacy = json.loads((tmp_path / "hospitals-clusters" / "privacy.json").read_text())
    assert privacy["aggregation"] == "secure" and privacy["mechanism"]["name"] == "secure-public-clusters"
    owners = privacy["owners"]
    assert set(owners) == {"hospital_a", "hospital_b", "hospital_c"}
    # every hospital paid the one release, exactly what the run's worst case is
    assert all(account["spent"]["charges"] - account["spent"]["charges_before_run"] == 1 for account in owners.values())
