"""``conclave run`` through three owners' gateways, end to end: examples/hospitals/gateways.py
starts three ``conclave owner serve`` processes on 127.0.0.1 (each its own Ray, its own policy and
ledger, mutual TLS) and the coordinator's ``conclave run`` on a config naming only their gateways.
The run's guarantee is each owner's ledger's charge (one cluster release), and the coordinator's
config holds no path to an owner's file, nor did its process open one."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import PROJECT_ROOT

SCRIPT = PROJECT_ROOT / "examples" / "hospitals" / "gateways.py"


def test_a_run_through_three_gateways_charges_each_owner_its_guarantee(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "results")], cwd=PROJECT_ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    results = tmp_path / "results" / "hospitals-clusters-gateways"
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


def test_teachers_trained_behind_three_gateways_teach_the_student_at_each_owners_charge(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "results"),
                          str(PROJECT_ROOT / "configs" / "hospitals.yaml")], cwd=PROJECT_ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    guarantee = json.loads((tmp_path / "results" / "hospitals-gateways" / "privacy.json").read_text())["guarantee"]
    assert guarantee["sound"] and guarantee["neighbouring"] == "add-remove"
    for owner, ledger in outcome["owners"].items():  # four batches of ten, each one secure round
        assert ledger["charges"] == 4 and ledger["labels"] == ["gnmax"], owner
        assert ledger["epsilon_spent"] == pytest.approx(guarantee["epsilon"], rel=1e-9), owner
    assert outcome["student_accuracy"] > 0.7 and outcome["opened_owner_files"] == []
    assert all(set(owner) == {"name", "gateway", "teachers"} for owner in outcome["config"]["owners"])
