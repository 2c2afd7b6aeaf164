"""Trial plumbing that needs no Ray: a trial's config, its reported charge, and what a
failed trial still reports."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from cluster.config import load_yaml
from privacy.accounting.ledger import PrivacyLedger
from privacy.accounting.rdp import DEFAULT_ORDERS, gaussian_charge, unbounded_charge
from tuning import trainables
from tuning.trainables import charge_fields, charge_from_fields, trial_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_threshold_fraction_scales_with_the_number_of_teachers():
    base = load_yaml(CONFIGS / "tune-digits-teachers.yaml")["base"]
    raw, config = trial_config("teacher_ensemble", base, {"teachers.count": 30,
                                                           "mechanism.params.threshold_fraction": 0.6})
    assert config.teachers.count == 30
    assert config.mechanism.params["threshold"] == pytest.approx(18.0)
    assert "threshold_fraction" not in raw["mechanism"]["params"]


def test_n_cluster_times_n_each_is_the_label_budget():
    base = load_yaml(CONFIGS / "tune-digits-diverse.yaml")["base"]
    _, config = trial_config("diverse_public", base, {"selection.n_cluster": 7, "selection.n_each": 4})
    assert list(config.selection.sizes) == [28] and config.selection.n_each == 4


def test_reported_charges_round_trip():
    charge = gaussian_charge(3.0, count=5)
    back = charge_from_fields(charge_fields(charge))
    np.testing.assert_array_equal(back.rdp, charge.rdp)
    assert not back.unbounded and back.extra_delta == 0
    assert charge_from_fields(charge_fields(unbounded_charge("nzc"))).unbounded
    with pytest.raises(ValueError, match="grid of orders"):
        charge_from_fields({"rdp": [1.0, 2.0], "extra_delta": 0.0, "unbounded": False})


def test_a_failed_trial_reports_what_its_ledger_recorded(tmp_path, monkeypatch):
    reports = []
    monkeypatch.setattr(trainables, "_report", lambda accuracy, epsilon, charge, **extra:
                        reports.append((accuracy, epsilon, charge, extra)))
    (tmp_path / "run").mkdir()
    with PrivacyLedger(tmp_path / "run" / "ledger.sqlite", math.inf, 1e-5) as ledger:
        ledger.charge(gaussian_charge(2.0, count=3, label="dpsgd"))
        expected = ledger.report().epsilon
    trainables._report_spent_before_failing(tmp_path, 1e-5)
    (accuracy, epsilon, charge, extra), = reports
    assert math.isnan(accuracy) and extra == {"failed": True}
    assert epsilon == pytest.approx(expected)
    np.testing.assert_allclose(charge.rdp, 3 * DEFAULT_ORDERS / (2 * 2.0**2))
