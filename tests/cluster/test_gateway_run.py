"""``conclave run`` through three owners' gateways, end to end: examples/hospitals/gateways.py
starts three ``conclave owner serve`` processes on 127.0.0.1 (each its own Ray, its own policy and
ledger, mutual TLS) and the coordinator's ``conclave run`` on a config naming only their gateways.
The run's guarantee is each owner's ledger's charge (one cluster release; or DP-SGD active learning's
steps, each charged at every gateway), and the coordinator's config holds no path to an owner's file,
nor did its process open one."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import PROJECT_ROOT

SCRIPT = PROJECT_ROOT / "examples" / "hospitals" / "gateways.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The three pipelines run one after another through the same three gateways (one start of
    their Rays): public clusters, teachers, and hospitals-active.yaml made smaller (3 epochs of 10
    steps; random and NearPrivate). Each outcome's ledgers are that run's charges alone."""
    folder = tmp_path_factory.mktemp("gateway-runs")
    config = yaml.safe_load((PROJECT_ROOT / "configs" / "hospitals-active.yaml").read_text())
    config["dpsgd"]["epochs"] = 3
    config["selection"].update(strategies=["random", "near_private"], sizes=[10, 20])
    config["finetune"]["epochs"] = 5
    active = folder / "hospitals-active.yaml"
    active.write_text(yaml.safe_dump(config, sort_keys=False))
    sources = [PROJECT_ROOT / "configs" / "hospitals-clusters.yaml", PROJECT_ROOT / "configs" / "hospitals.yaml", active]
    run = subprocess.run([sys.executable, str(SCRIPT), str(folder / "results"), *map(str, sources)],
                         cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    outcomes = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(outcomes) == 3, run.stdout[-3000:]
    return {"results": folder / "results", "clusters": outcomes[0], "teachers": outcomes[1], "active": outcomes[2]}


def test_a_run_through_three_gateways_charges_each_owner_its_guarantee(runs):
    outcome = runs["clusters"]
    results = runs["results"] / "hospitals-clusters-gateways"
    assert {"privacy.json", "metrics.json", "config.json"} <= {path.name for path in results.iterdir()}
    guarantee = json.loads((results / "privacy.json").read_text())["guarantee"]
    assert guarantee["sound"] and guarantee["basis"] == "worst-case"
    for owner, ledger in outcome["owners"].items():
        assert ledger["charges"] == 1 and ledger["labels"] == ["public-clusters"], owner
        assert ledger["epsilon_spent"] == pytest.approx(guarantee["epsilon"], rel=1e-9), owner
    assert outcome["student_accuracy"] > 0.7
    config = json.dumps(outcome["config"])
    assert all(set(owner) == {"name", "gateway"} for owner in outcome["config"]["owners"])
    assert "records.csv" not in config and "/hospital_" not in config  # no owner's file or folder
    assert outcome["opened_owner_files"] == []


def test_teachers_trained_behind_three_gateways_teach_the_student_at_each_owners_charge(runs):
    outcome = runs["teachers"]
    guarantee = json.loads((runs["results"] / "hospitals-gateways" / "privacy.json").read_text())["guarantee"]
    assert guarantee["sound"] and guarantee["neighbouring"] == "add-remove"
    for owner, ledger in outcome["owners"].items():  # one batch of ten: one secure round
        assert ledger["charges"] == 1 and ledger["labels"] == ["gnmax"], owner
        assert ledger["epsilon_spent"] == pytest.approx(guarantee["epsilon"], rel=1e-9), owner
    assert outcome["student_accuracy"] > 0.7 and outcome["opened_owner_files"] == []
    assert all(set(owner) == {"name", "gateway", "teachers"} for owner in outcome["config"]["owners"])


def test_dpsgd_active_learning_through_three_gateways_charges_each_owner_every_release(runs):
    """hospitals-active.yaml, smaller (3 epochs of 10 steps; random and NearPrivate): every step a secure
    sum of the gateways' shares, then NearPrivate's DP-PCA and support counts, each owner's ledger one
    charge per step and per release, adding up to the guarantee."""
    outcome = runs["active"]
    results = runs["results"] / "hospitals-active-gateways"
    privacy = json.loads((results / "privacy.json").read_text())
    guarantee = privacy["guarantee"]
    assert guarantee["sound"] and guarantee["neighbouring"] == "add-remove"
    assert privacy["dpsgd"]["declared_private_size"] == 300 and privacy["dpsgd"]["gateways"] == 3
    for owner, ledger in outcome["owners"].items():  # 300 declared records, batches of 30: 10 steps an epoch
        assert ledger["charges"] == 32 and sorted(ledger["labels"]) == ["dp-pca", "dpsgd", "noisy-counts"], owner
        assert ledger["epsilon_spent"] == pytest.approx(guarantee["epsilon"], rel=1e-9), owner
        earlier = runs["clusters"]["owners"][owner]["charges"] + runs["teachers"]["owners"][owner]["charges"]
        lifetime = privacy["owners"][owner]["spent"]  # the owner's ledger after the run: all three runs
        assert lifetime["charges"] == earlier + 32 and lifetime["charges_before_run"] == earlier, owner
    metrics = json.loads((results / "metrics.json").read_text())
    assert [c["epoch"] for c in metrics["checkpoints"]] == [1, 2, 3]
    assert {row["strategy"] for row in metrics["results"]} == {"random", "near_private"}
    assert privacy["near_private"]["epsilon_total"] <= guarantee["epsilon"] + 1e-9
    assert outcome["dp_checkpoint_accuracy"] > 0.7 and outcome["opened_owner_files"] == []
    assert all(set(owner) == {"name", "gateway"} for owner in outcome["config"]["owners"])
    assert "records.csv" not in json.dumps(outcome["config"])
