"""``conclave serve`` serves every shipped config it takes (``configs/*.yaml`` with ``pipeline:
teacher_student``): before, every public-cluster config, the demo included, logged "aggregator
serving" and crashed. The digits and hospitals configs are served as shipped, but for fewer
teachers trained shorter (``TINY``); each MNIST config is of a kind (vote source, aggregation,
owners) one of them serves, which the last test checks, as loading and embedding MNIST for each
would take minutes. Real ``serve`` in this process on the session's Ray, a real client on
127.0.0.1, real ledger files."""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from conclave.cluster.client import AggregatorClient
from conclave.cluster.config import load_yaml
from conclave.cluster.pipelines import load_pipeline
from conclave.cluster.teaching.config import TeacherStudentConfig

ROOT = Path(__file__).resolve().parents[2]
# Each served config's override: fewer teachers, trained for one epoch (the vote source's kind unchanged).
TINY: dict[str, dict[str, Any]] = {
    "demo.yaml": {},
    "digits-knn.yaml": {},
    "digits-teachers.yaml": {"teachers": {"count": 2, "train": {"epochs": 1, "batch_size": 32, "lr": 0.003}}},
    "hospitals.yaml": {"owner_teachers": 2, "teachers": {"train": {"epochs": 2, "batch_size": 8, "lr": 0.05}}},
    "hospitals-knn.yaml": {},
    "hospitals-clusters.yaml": {},
}


def _served(name: str) -> dict[str, Any]:
    raw = load_yaml(ROOT / "configs" / name)
    override = dict(TINY[name])
    teachers = override.pop("owner_teachers", None)
    if teachers is not None:
        raw["owners"] = [{**owner, "teachers": teachers} for owner in raw["owners"]]
    for section, values in override.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


def _kind(config: TeacherStudentConfig) -> tuple[str, str, bool]:
    voters = config.vote_source.kind
    return voters, config.aggregation, bool(config.owners)


def _serveable() -> list[Path]:
    return [path for path in sorted((ROOT / "configs").glob("*.yaml")) if load_yaml(path).get("pipeline") ==
            "teacher_student"]


@pytest.mark.parametrize("name", sorted(TINY))
def test_serve_serves_a_shipped_config_and_answers_a_client(name, ray_session, tmp_path, monkeypatch, capsys):
    from conclave.cluster import serve_command
    from conclave.cluster.cli import build_parser
    from conclave.cluster.teaching.ensemble import checked_public

    monkeypatch.chdir(ROOT)  # the configs' paths are relative to the project root
    monkeypatch.setenv("CONCLAVE_HOME", str(tmp_path / "home"))  # the owners' lifetime ledgers
    monkeypatch.setenv("CONCLAVE_TOKEN", "t")
    raw = _served(name)
    config_file = tmp_path / name
    config_file.write_text(yaml.safe_dump(raw))
    inputs = checked_public(load_pipeline(raw).config).splits.public.x[:6].astype(np.float32)
    args = build_parser("serve").parse_args(["serve", str(config_file), "--ledger", str(tmp_path / "l.sqlite"),
                                             "--port", "0"])
    stop, status = threading.Event(), []
    serving = threading.Thread(target=lambda: status.append(serve_command.main(args, stop)), daemon=True)
    serving.start()
    printed, deadline = "", time.monotonic() + 240
    try:
        while "press Ctrl-C" not in printed:
            captured = capsys.readouterr()
            printed += captured.out
            assert serving.is_alive() and time.monotonic() < deadline, printed + captured.err
            time.sleep(0.05)
        address = re.search(r"aggregator serving on (\S+) ", printed).group(1)
        with AggregatorClient(address, token="t") as client:
            labels = client.label(inputs)
            assert labels.shape == (6,) and client.budget()["queries_answered"] + \
                client.budget()["queries_abstained"] == 6
    finally:
        stop.set()
        serving.join(120)
    printed += capsys.readouterr().out
    assert status == [0] and "stopped; realised spend" in printed, printed


def test_every_shipped_config_serve_takes_is_of_a_kind_served_above():
    served = {_kind(load_pipeline(_served(name)).config) for name in TINY}
    for path in _serveable():
        assert _kind(load_pipeline(load_yaml(path)).config) in served, path.name
    assert {path.name for path in _serveable()} >= set(TINY)
