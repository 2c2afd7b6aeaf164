"""Trial plumbing that needs no Ray: a trial's config, its reported charge, and what a
failed trial still reports."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from conclave.cluster.config import load_yaml
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.accounting.pld import pld_epsilon
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp, gaussian_charge, unbounded_charge
from conclave.tuning import trainables
from conclave.tuning.trainables import charge_fields, charge_from_fields, trial_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_threshold_fraction_scales_with_the_number_of_teachers():
    base = load_yaml(CONFIGS / "tune-digits-teachers.yaml")["base"]
    raw, pipeline = trial_config("teacher_ensemble", base, {"teachers.count": 30,
                                                             "mechanism.params.threshold_fraction": 0.6})
    config = pipeline.config
    assert config.teachers.count == 30
    assert config.mechanism.params["threshold"] == pytest.approx(18.0)
    assert "threshold_fraction" not in raw["mechanism"]["params"]


def test_n_cluster_times_n_each_is_the_label_budget():
    base = load_yaml(CONFIGS / "tune-digits-diverse.yaml")["base"]
    config = trial_config("diverse_public", base, {"selection.n_cluster": 7, "selection.n_each": 4})[1].config
    assert list(config.selection.sizes) == [28] and config.selection.n_each == 4


def test_reported_charges_round_trip():
    charge = gaussian_charge(3.0, count=5)
    back = charge_from_fields(charge_fields(charge))
    np.testing.assert_array_equal(back.rdp, charge.rdp)
    assert not back.unbounded and back.extra_delta == 0
    assert back.pld == charge.pld is not None  # the Gaussian plan travels: the sweep's PLD needs it
    assert charge_from_fields(charge_fields(unbounded_charge("nzc"))).unbounded
    with pytest.raises(ValueError, match="grid of orders"):
        charge_from_fields({"rdp": [1.0, 2.0], "extra_delta": 0.0, "unbounded": False})


def test_a_failed_trial_reports_its_planned_worst_case_or_nothing_spent(tmp_path, monkeypatch):
    reports = []
    monkeypatch.setattr(trainables, "_report", lambda accuracy, epsilon, charge, **extra:
                        reports.append((accuracy, epsilon, charge, extra)))
    _, pipeline = trial_config("sparsity", load_yaml(CONFIGS / "tune-digits-sparsity.yaml")["base"],
                                 {"finetune.variants": ["all"]})
    trainables._report_planned_before_failing(pipeline, tmp_path)  # no ledger: nothing was released
    (accuracy, epsilon, charge, extra), = reports
    assert math.isnan(accuracy) and extra == {"failed": True} and epsilon == 0 and not np.any(charge.rdp)

    reports.clear()
    (tmp_path / "run").mkdir()
    with PrivacyLedger(tmp_path / "run" / "ledger.sqlite", 1e-5) as ledger:
        ledger.charge(gaussian_charge(2.0, count=3, label="dpsgd"))  # something was released
    trainables._report_planned_before_failing(pipeline, tmp_path)
    (accuracy, epsilon, charge, extra), = reports
    planned = pipeline.plan()
    np.testing.assert_allclose(charge.rdp, planned.rdp)  # the whole planned work, not what was recorded
    # the plan's worst case: the smaller of its RDP conversion and its Gaussian plan's PLD
    by_pld = pld_epsilon(planned.pld, 1e-5) if planned.pld is not None else math.inf
    assert epsilon == pytest.approx(min(epsilon_from_rdp(DEFAULT_ORDERS, planned.rdp, 1e-5)[0], by_pld))
