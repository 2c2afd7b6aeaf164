"""Owners' lifetime budgets through real runs: each owner's ledger, in an actor on its node,
is charged by every run before anything is released; runs compose in it; an owner whose
budget is spent stops a run before any release while the others' budgets are untouched; a
deleted ledger with a record elsewhere is a refusal, not a fresh budget; ``conclave budget``
lists the owners and their charges."""
from __future__ import annotations

import json

import pytest
import yaml

from conclave.cluster import cli
from conclave.cluster.config import load_yaml
from tests.conftest import PROJECT_ROOT

HOSPITALS = PROJECT_ROOT / "configs" / "hospitals.yaml"
OWNERS = ("hospital_a", "hospital_b", "hospital_c")


def small_hospitals(tmp_path, lifetime: dict[str, float]):
    """The hospitals config, 5 teachers an owner, 20 queries in batches of 10 under GNMax
    σ = 10 (RDP λ/100 an answer), each owner's ledger in a folder of its own ("its node"); one
    epoch of training: the charges and refusals checked here do not depend on what was learned."""
    raw = load_yaml(HOSPITALS)
    for owner in raw["owners"]:
        owner["teachers"] = 5
        owner["budget"] = {"epsilon": lifetime[owner["name"]], "delta": 1e-5,
                           "directory": str(tmp_path / "nodes" / owner["name"])}
    raw["student"].update(queries=20, batch_size=10, checkpoints=[10])
    raw["teachers"]["train"]["epochs"] = 1
    raw["student"]["train"]["epochs"] = 1
    path = tmp_path / "hospitals.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run(config, tmp_path, capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.chdir(PROJECT_ROOT)
    code = cli.main(["run", str(config), "--results-dir", str(tmp_path / "results")])
    return code, capsys.readouterr().err


def privacy(tmp_path) -> dict:
    return json.loads((tmp_path / "results" / "hospitals" / "privacy.json").read_text())


@pytest.mark.slow
def test_runs_compose_in_each_owners_ledger_until_one_owners_budget_stops_them(ray_session, tmp_path, capsys,
                                                                             monkeypatch):
    # hospital_a: ε 4.5 at its order fits 45 answers: two runs of 20, then 5 of a third run's batch of 10
    config = small_hospitals(tmp_path, {"hospital_a": 4.5, "hospital_b": 50.0, "hospital_c": 50.0})
    code, err = run(config, tmp_path, capsys, monkeypatch)
    assert code == 0, err
    first = privacy(tmp_path)["owners"]
    assert set(first) == set(OWNERS)
    assert all(first[o]["spent"]["charges"] == 2 and first[o]["spent"]["charges_before_run"] == 0 for o in OWNERS)
    assert first["hospital_a"]["guarantee"]["epsilon"] == 4.5 and first["hospital_a"]["guarantee"]["basis"] == \
        "renyi-filter"
    for owner in OWNERS:  # each ledger in its own owner's folder
        assert (tmp_path / "nodes" / owner / f"{owner}.sqlite").is_file()

    monkeypatch.chdir(PROJECT_ROOT)
    assert cli.main(["run", str(config), "--results-dir", str(tmp_path / "results")]) == 0
    printed = capsys.readouterr().out
    assert "owners (lifetime budgets): hospital_a: ε 4.5 lifetime" in printed and "(2 before this run)" in printed
    second = privacy(tmp_path)["owners"]
    for owner in OWNERS:  # the second run's accounts hold the first run's charges too
        assert second[owner]["spent"]["charges"] == 4 and second[owner]["spent"]["charges_before_run"] == 2
        assert second[owner]["spent"]["epsilon"] > first[owner]["spent"]["epsilon"]

    code, err = run(config, tmp_path, capsys, monkeypatch)
    assert code == 0, err
    metrics = json.loads((tmp_path / "results" / "hospitals" / "metrics.json").read_text())
    third = privacy(tmp_path)["owners"]
    # hospital_a's budget pays 5 more answers: those are answered, the rest refused before release
    assert metrics["queries_answered"] == 5 and metrics["budget_exhausted"]
    assert {o: third[o]["spent"]["charges"] for o in OWNERS} == dict.fromkeys(OWNERS, 5)  # all paid for those 5
    assert third["hospital_a"]["spent"]["rdp_left"] < third["hospital_a"]["guarantee"]["order"] / 100  # < 1 answer

    code = cli.main(["budget", str(tmp_path / "nodes" / "hospital_a"), str(tmp_path / "nodes" / "hospital_b"),
                     str(tmp_path / "nodes" / "hospital_c"), "--json"])
    listed = json.loads(capsys.readouterr().out)
    assert code == 0 and [v["name"] for v in listed] == list(OWNERS)
    assert all(v["spent"]["charges"] == 5 and v["runs"] == ["hospitals"] for v in listed)
    assert {h["what"] for h in listed[0]["history"]} == {"gnmax"}

    (tmp_path / "nodes" / "hospital_a" / "hospital_a.sqlite").unlink()  # a fresh budget, by deleting it?
    code, err = run(config, tmp_path, capsys, monkeypatch)
    (line,) = [line for line in err.splitlines() if line.startswith("conclave:")]  # stderr also has progress bars
    assert code == 2 and "owner hospital_a: its ledger is missing, but the driver has a record of 5 charges" in line


@pytest.mark.slow
def test_a_dp_sgd_run_past_one_owners_budget_is_refused_before_training_in_one_line(ray_session, tmp_path, capsys,
                                                                                  monkeypatch):
    """Owners with different lifetime budgets are each held to their own: hospital_b's ε 0.5
    cannot pay for the DP-SGD schedule, so nothing is trained or released and no owner pays."""
    raw = load_yaml(PROJECT_ROOT / "configs" / "hospitals-active.yaml")
    lifetime = {"hospital_a": 50.0, "hospital_b": 0.5, "hospital_c": 50.0}
    for owner in raw["owners"]:
        owner["budget"] = {"epsilon": lifetime[owner["name"]], "delta": 1e-5,
                           "directory": str(tmp_path / "nodes" / owner["name"])}
    path = tmp_path / "hospitals-active.yaml"
    path.write_text(yaml.safe_dump(raw))
    code, err = run(path, tmp_path, capsys, monkeypatch)
    (line,) = [line for line in err.splitlines() if line.startswith("conclave:")]
    assert code == 4 and "refused by a privacy ledger: owner hospital_b's lifetime budget ε 0.5" in line, err
    assert "left at Rényi order" in line
    listed = {}
    for owner in OWNERS:
        cli.main(["budget", str(tmp_path / "nodes" / owner), "--json"])
        (entry,) = json.loads(capsys.readouterr().out)
        listed[owner] = entry["spent"]["charges"]
    assert listed == dict.fromkeys(OWNERS, 0)  # checked for everyone before anyone was charged
    assert not (tmp_path / "results" / "hospitals-active" / "checkpoints").exists()  # nothing trained
