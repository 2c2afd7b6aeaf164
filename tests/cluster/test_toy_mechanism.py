"""A mechanism is one file and one registry line: ``tests/toy_mechanism.py``'s ``ToyMax``, made known
with ``register(ToyMax)``, goes through ``conclave plan``, ``run`` and ``serve`` end to end (real Ray,
real gRPC on 127.0.0.1), the default it leaves to the votes, its noise rows and warnings and its
budget note read from its class alone."""
from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from conclave.cluster.cli import main as cli_main
from conclave.cluster.client import AggregatorClient
from conclave.learning.data import load_dataset
from conclave.privacy.accounting.ledger import read_history
from conclave.privacy.mechanisms import MECHANISMS, register
from tests.toy_mechanism import ToyMax

ROOT = Path(__file__).resolve().parents[2]
TOY = {
    "pipeline": "teacher_student",
    "name": "toy",
    "seed": 1,
    "data": {"name": "digits", "public_size": 200},
    "teachers": {"count": 4, "model": "digits_cnn", "train": {"epochs": 1, "batch_size": 32, "lr": 0.003}},
    "mechanism": {"name": "toy-max", "params": {"sigma": 2.0}},
    "privacy": {"budget": 1000.0, "delta": 1.0e-5},
    "student": {"queries": 40, "batch_size": 40, "model": "digits_cnn",
                "train": {"epochs": 1, "batch_size": 32, "lr": 0.003}},
}


@pytest.fixture
def toy(tmp_path) -> Path:
    """``ToyMax`` registered for this test, and a config naming it."""
    register(ToyMax)
    config = tmp_path / "toy.yaml"
    config.write_text(yaml.safe_dump(TOY))
    yield config
    MECHANISMS.pop(ToyMax.name)


def plan(config: Path, capsys) -> dict:
    assert cli_main(["plan", str(config), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_reads_the_toys_default_noise_and_warnings_from_its_class(toy, tmp_path, capsys):
    planned = plan(toy, capsys)
    assert planned["table"][0]["parameters"] == {"sigma": 2.0, "floor": 2.0}  # the floor its class fills: 4 votes / 2
    assert planned["work"].startswith("toy-max (sigma 2, floor 2) on 40 queries")
    assert [row["setting"] for row in planned["table"]] == [
        "sigma 2 (configured)", "sigma 1.5 (×0.75)", "sigma 3 (×1.5)", "sigma 4 (×2)"]
    assert planned["warnings"] == []
    # Its charge per asked query is GNMax's per answer at the same σ: the same planned guarantee.
    gnmax = tmp_path / "gnmax.yaml"
    gnmax.write_text(yaml.safe_dump({**TOY, "mechanism": {"name": "gnmax", "params": {"sigma": 2.0}}}))
    assert planned["guarantee"] == plan(gnmax, capsys)["guarantee"]

    noisy = tmp_path / "noisy.yaml"  # noise past the 4 votes, and a budget smaller than the plan
    noisy.write_text(yaml.safe_dump({**TOY, "mechanism": {"name": "toy-max", "params": {"sigma": 5.0}},
                                     "privacy": {"budget": 1.0, "delta": 1.0e-5}}))
    warnings = plan(noisy, capsys)["warnings"]
    assert warnings[0] == ("toy-max sigma 5 is at least the 4 teachers: the noise outweighs even a unanimous "
                           "vote's margin")
    assert warnings[1].endswith("could pass it (an abstention costs as much as an answer)")


def test_run_answers_with_the_toy_and_charges_what_it_describes(ray_session, toy, tmp_path, capsys):
    assert cli_main(["run", str(toy), "--results-dir", str(tmp_path / "results")]) == 0
    capsys.readouterr()
    run_dir = tmp_path / "results" / "toy"
    privacy = json.loads((run_dir / "privacy.json").read_text())
    assert privacy["mechanism"]["name"] == "toy-max" and privacy["mechanism"]["parameters"]["floor"] == 2.0
    history = read_history(run_dir / "ledger.sqlite")
    assert history and {entry.label for entry in history} == {"toy-max"}
    asked = sum(entry.details["count"] for entry in history)
    assert asked == TOY["student"]["queries"]  # every asked query paid, answered or not


def test_serve_labels_over_grpc_with_the_toy(toy, ray_session, tmp_path, monkeypatch, capsys):
    """``conclave serve`` in this process (where the toy is registered), on the session's Ray, and a
    real client over gRPC on 127.0.0.1."""
    from conclave.cluster import serve_command
    from conclave.cluster.cli import build_parser

    monkeypatch.setenv("CONCLAVE_TOKEN", "t")
    args = build_parser("serve").parse_args(["serve", str(toy), "--ledger", str(tmp_path / "serve.sqlite"),
                                             "--port", "0"])
    stop, status = threading.Event(), []
    serving = threading.Thread(target=lambda: status.append(serve_command.main(args, stop)), daemon=True)
    serving.start()
    printed, deadline = "", time.monotonic() + 600
    try:
        while "press Ctrl-C" not in printed:
            captured = capsys.readouterr()
            printed += captured.out
            assert serving.is_alive() and time.monotonic() < deadline, printed + captured.err
            time.sleep(0.05)
        address = re.search(r"aggregator serving on (\S+)", printed)
        assert address, printed
        test = load_dataset("digits")[1]
        with AggregatorClient(address.group(1), token="t") as client:
            label = client.label(test.x[:1].astype(np.float32))
            budget = client.budget()
        assert label.shape == (1,) and -1 <= label[0] < 10
        assert budget["mechanism"] == "toy-max"
        assert budget["queries_answered"] + budget["queries_abstained"] == 1
    finally:
        stop.set()
        serving.join(120)
    printed += capsys.readouterr().out
    assert status == [0] and "stopped; realised spend" in printed, printed
    assert [entry.label for entry in read_history(tmp_path / "serve.sqlite")] == ["toy-max"]
