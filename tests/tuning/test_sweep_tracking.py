"""A sweep is logged by its own top-level tracking section, not its base's. What sweeps log to
MLflow (each trial as a child run of one summary run; a random-repetition sweep's winner alone,
with nothing that tells how many trials ran or when they ended) is checked on the sweeps of
test_sweeps.py, each run once for both."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conclave.cluster.config import ConfigError, from_dict, load_yaml
from conclave.cluster.tracking import TrackingConfig
from conclave.tuning.config import TuneConfig
from conclave.tuning.sweep import check

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _config(store: Path, **top) -> TuneConfig:
    """configs/tune-digits-sparsity.yaml, shrunk: one epoch of each training, logged to ``store``."""
    raw = load_yaml(CONFIGS / "tune-digits-sparsity.yaml")
    raw["base"]["pretrain"]["epochs"] = raw["base"]["finetune"]["epochs"] = 1
    raw.update(top, tracking={"mlflow": True, "tracking_uri": store.as_uri(), "experiment": "sweep"})
    return from_dict(TuneConfig, raw)


def test_a_sweep_base_may_not_carry_its_own_tracking_section(tmp_path):
    config = _config(tmp_path / "mlruns")
    base = {**config.base, "tracking": {"mlflow": True}}
    with pytest.raises(ConfigError, match="^base.tracking: a sweep is logged by its own top-level tracking section$"):
        check(dataclasses.replace(config, base=base))
    assert config.tracking == TrackingConfig(True, (tmp_path / "mlruns").as_uri(), "sweep")
