"""Every shipped config (``configs/*.yaml``; a sweep's ``base``) loads to the values it loaded
to, and plans the guarantee it planned, when ``shipped_configs.json`` was written: a change to
how configs are read or typed must not change what a run does or states.

A config changed on purpose changes its entry: ``python -m tests.cluster.test_shipped_configs``
rewrites the file from the configs as they load now (review the diff).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from conclave.cluster.config import load_yaml
from conclave.cluster.pipelines import load_pipeline
from conclave.cluster.results import _jsonable
from conclave.privacy.accounting.guarantee import worst_case_guarantee

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = Path(__file__).with_name("shipped_configs.json")
EXPECTED = json.loads(SNAPSHOT.read_text())


def loaded(path: Path) -> dict[str, Any]:
    """What ``path`` loads to: its pipeline, its config's values, and its planned guarantee."""
    raw = load_yaml(path)
    pipeline = load_pipeline(raw.get("base", raw))  # a sweep's base is a run config
    config, planned = pipeline.config, pipeline.plan()
    guarantee = pipeline.guarantee()
    return {"pipeline": pipeline.name, "config": _jsonable(dataclasses.asdict(config)),
            "guarantee": {"epsilon": guarantee.epsilon, "delta": guarantee.delta, "basis": guarantee.basis,
                          "planned_worst_case": worst_case_guarantee(planned, config.privacy.delta).epsilon}}


def test_every_shipped_config_has_an_entry():
    assert sorted(EXPECTED) == sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_shipped_config_loads_to_the_same_values_and_guarantee(name):
    assert json.loads(json.dumps(loaded(ROOT / "configs" / name))) == _close_to(EXPECTED[name])


def _close_to(expected: Any) -> Any:
    """``expected`` with every float compared to 1e-7 relative: a planned ε goes through SciPy's
    numerics, whose last digits move between releases (the pin is dp-accounting's, not SciPy's)."""
    if isinstance(expected, dict):
        return {key: _close_to(value) for key, value in expected.items()}
    if isinstance(expected, list):
        return [_close_to(value) for value in expected]
    if isinstance(expected, float):
        return pytest.approx(expected, rel=1e-7, abs=1e-12)
    return expected


if __name__ == "__main__":
    snapshot = {p.name: loaded(p) for p in sorted((ROOT / "configs").glob("*.yaml"))}
    SNAPSHOT.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
