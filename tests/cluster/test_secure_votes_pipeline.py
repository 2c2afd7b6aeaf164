"""``aggregation: secure`` in the teacher_student pipeline: config checks (the three hospitals' run end
to end, their votes meeting only in the secure sum: tests/cluster/test_owners.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from conclave.cluster.config import ConfigError, load_yaml
from conclave.cluster.pipelines import load_pipeline
from conclave.privacy.mechanisms import SecureGNMax

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def hospitals(**changes) -> dict:
    config = load_yaml(PROJECT_ROOT / "configs" / "hospitals.yaml")
    config.update(changes)
    return config


def test_secure_aggregation_plans_the_skellam_charge_of_the_secure_variant():
    config = load_pipeline(hospitals(aggregation="secure")).config
    assert config.vote_mechanism == SecureGNMax(5.0)
    planned = config.planned()
    expected = SecureGNMax(5.0).run_charge(10, 10)
    assert planned.neighbouring == "add-remove" and (planned.rdp == expected.rdp).all()
    assert load_pipeline(hospitals()).config.vote_mechanism == SecureGNMax(5.0)  # with owners, left out: secure


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
