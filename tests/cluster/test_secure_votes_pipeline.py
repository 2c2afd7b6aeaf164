"""``aggregation: secure`` in the teacher_student pipeline: config checks, and the three hospitals'
run end to end (real Ray actors, real gRPC) with the votes meeting only in the secure sum."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conclave.cluster.cli import main as cli_main
from conclave.cluster.config import ConfigError, load_yaml
from conclave.cluster.pipelines import load_pipeline
from conclave.privacy.accounting.rdp import epsilon_from_rdp
from conclave.privacy.mechanisms import SecureGNMax

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def hospitals(**changes) -> dict:
    config = load_yaml(PROJECT_ROOT / "configs" / "hospitals.yaml")
    config.update(changes)
    return config


def test_secure_aggregation_plans_the_skellam_charge_of_the_secure_variant():
    config = load_pipeline(hospitals(aggregation="secure")).config
    assert config.vote_mechanism == SecureGNMax(10.0)
    planned = config.planned()
    expected = SecureGNMax(10.0).run_charge(40, 40)
    assert planned.neighbouring == "add-remove" and (planned.rdp == expected.rdp).all()
    trusted = load_pipeline(hospitals()).config
    assert trusted.aggregation == "trusted-aggregator" and trusted.vote_mechanism.name == "gnmax"


@pytest.mark.parametrize("changes, named", [
    ({"aggregation": "secure", "mechanism": {"name": "lnmax", "params": {"laplace_scale": 20.0}}},
     "mechanism lnmax needs clean vote histograms, which aggregation: secure never shows the aggregator; "
     "use one of gnmax, confident-gnmax"),
    ({"aggregation": "secure", "estimates": {"smooth_sensitivity": True}}, "estimates.smooth_sensitivity"),
    ({"aggregation": "federated"}, "aggregation must be one of trusted-aggregator, secure"),
])
def test_what_secure_aggregation_cannot_do_is_refused_in_one_line(changes, named):
    with pytest.raises(ConfigError, match=named) as refused:
        load_pipeline(hospitals(**changes))
    assert "\n" not in str(refused.value)


def test_three_hospitals_teach_a_student_through_secure_vote_sums(ray_session, tmp_path, monkeypatch):
    config = hospitals(aggregation="secure", student={**hospitals()["student"], "queries": 20, "checkpoints": [10]})
    config_file = tmp_path / "secure.yaml"
    config_file.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(PROJECT_ROOT)  # the config's owner paths are the project root's
    assert cli_main(["run", str(config_file), "--results-dir", str(tmp_path / "results")]) == 0
    run_dir = tmp_path / "results" / "hospitals"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    privacy = json.loads((run_dir / "privacy.json").read_text())

    assert metrics["queries_asked"] == 20 and metrics["queries_answered"] == 20  # GNMax answers every query
    assert metrics["student_accuracy"] > 0.6  # majority class 0.63: a sanity floor, not a benchmark
    assert privacy["aggregation"] == "secure" and privacy["trust_model"]["trusted"] == []
    assert "masked share" in privacy["trust_model"]["statement"]
    assert privacy["mechanism"]["name"] == "secure-gnmax"
    assert privacy["estimates"] == [] and "clean votes" in privacy["estimates_note"]
    assert set(privacy["spent"]["by_label"]) == {"secure-gnmax"}
    planned = SecureGNMax(10.0).run_charge(20, 20)
    worst = epsilon_from_rdp(planned.orders, planned.rdp, 1e-5)[0]
    assert privacy["guarantee"]["basis"] == "worst-case" and privacy["guarantee"]["epsilon"] == pytest.approx(worst)
    assert privacy["spent"]["epsilon"] == pytest.approx(worst)  # every planned query was answered
