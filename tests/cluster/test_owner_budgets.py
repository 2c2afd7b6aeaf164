"""Owners' lifetime budgets through real runs: each owner's ledger, kept by its gateway (started on
this machine by the run: the owners are named by their data), is charged before anything is
released; runs compose in it; an owner whose budget is spent stops a run part-way while the
others' budgets are untouched but for the round it refused; a deleted ledger with a record
elsewhere is a refusal, not a fresh budget; ``conclave budget`` lists the owners and their charges."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from conclave.cluster import cli
from conclave.cluster.config import load_yaml
from conclave.cluster.pipelines import load_pipeline
from tests.conftest import PROJECT_ROOT

HOSPITALS = PROJECT_ROOT / "configs" / "hospitals.yaml"
OWNERS = ("hospital_a", "hospital_b", "hospital_c")


def small_hospitals(tmp_path, lifetime: dict[str, float]):
    """The hospitals config, 5 teachers an owner, 20 queries in batches of 10 (two secure rounds) under
    GNMax σ = 10, each owner's ledger in a folder of its own ("its machine"); one epoch of training:
    the charges and refusals checked here do not depend on what was learned."""
    raw = load_yaml(HOSPITALS)
    for owner in raw["owners"]:
        owner["teachers"] = 5
        owner["budget"] = {"epsilon": lifetime[owner["name"]], "delta": 1e-5,
                           "directory": str(tmp_path / "nodes" / owner["name"])}
    raw["mechanism"]["params"]["sigma"] = 10.0
    raw["student"].update(queries=20, batch_size=10, checkpoints=[10])
    raw["teachers"]["train"]["epochs"] = 1
    raw["student"]["train"]["epochs"] = 1
    path = tmp_path / "hospitals.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def lifetime_paying(config_path, rounds: int) -> float:
    """The smallest lifetime ε (to 0.01) whose Rényi filter, at the order its ledger fixes from a run's
    plan, pays ``rounds`` rounds of 10 answers (each owner's charge per round, as its gateway makes it)."""
    from conclave.privacy.accounting.filter import choose_order, order_index, rdp_budget

    config = load_pipeline(load_yaml(config_path)).config
    planned, one_round = config.planned(), config.planned(answers=10)
    for epsilon in np.arange(1.0, 20.0, 0.01):
        order = choose_order(planned, float(epsilon), 1e-5)
        if rounds * one_round.rdp[order_index(order, one_round.orders)] <= rdp_budget(float(epsilon), 1e-5, order):
            return round(float(epsilon), 2)
    raise AssertionError("no lifetime below ε 20 pays for it")


def run(config, tmp_path, capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.chdir(PROJECT_ROOT)
    code = cli.main(["run", str(config), "--results-dir", str(tmp_path / "results")])
    return code, capsys.readouterr().err


def privacy(tmp_path) -> dict:
    return json.loads((tmp_path / "results" / "hospitals" / "privacy.json").read_text())


@pytest.mark.slow
def test_runs_compose_in_each_owners_ledger_until_one_owners_budget_stops_them(ray_session, tmp_path, capsys,
                                                                             monkeypatch):
    # hospital_a's lifetime pays five rounds of ten answers: two runs of two rounds, then one of a third run's two
    lifetime = lifetime_paying(small_hospitals(tmp_path, dict.fromkeys(OWNERS, 50.0)), 5)
    config = small_hospitals(tmp_path, {"hospital_a": lifetime, "hospital_b": 50.0, "hospital_c": 50.0})
    code, err = run(config, tmp_path, capsys, monkeypatch)
    assert code == 0, err
    first = privacy(tmp_path)["owners"]
    assert set(first) == set(OWNERS)
    assert all(first[o]["spent"]["charges"] == 2 and first[o]["spent"]["charges_before_run"] == 0 for o in OWNERS)
    assert first["hospital_a"]["guarantee"]["epsilon"] == lifetime and first["hospital_a"]["guarantee"]["basis"] == \
        "renyi-filter"
    for owner in OWNERS:  # each ledger in its own owner's folder
        assert (tmp_path / "nodes" / owner / f"{owner}.sqlite").is_file()

    monkeypatch.chdir(PROJECT_ROOT)
    assert cli.main(["run", str(config), "--results-dir", str(tmp_path / "results")]) == 0
    printed = capsys.readouterr().out
    assert f"owners (lifetime budgets): hospital_a: ε {lifetime:g} lifetime" in printed
    assert "(2 before this run)" in printed
    second = privacy(tmp_path)["owners"]
    for owner in OWNERS:  # the second run's accounts hold the first run's charges too
        assert second[owner]["spent"]["charges"] == 4 and second[owner]["spent"]["charges_before_run"] == 2
        assert second[owner]["spent"]["epsilon"] > first[owner]["spent"]["epsilon"]

    code, err = run(config, tmp_path, capsys, monkeypatch)
    assert code == 0, err
    metrics = json.loads((tmp_path / "results" / "hospitals" / "metrics.json").read_text())
    third = privacy(tmp_path)["owners"]
    # hospital_a's budget pays one more round: its answers are released, the next round is refused by it
    # before any share is decoded (the others, asked at once, charged that round: more, never less)
    assert metrics["queries_answered"] == 10 and metrics["budget_exhausted"]
    assert {o: third[o]["spent"]["charges"] for o in OWNERS} == {"hospital_a": 5, "hospital_b": 6, "hospital_c": 6}

    code = cli.main(["budget", str(tmp_path / "nodes" / "hospital_a"), str(tmp_path / "nodes" / "hospital_b"),
                     str(tmp_path / "nodes" / "hospital_c"), "--json"])
    listed = json.loads(capsys.readouterr().out)
    assert code == 0 and [v["name"] for v in listed] == list(OWNERS)
    assert [v["spent"]["charges"] for v in listed] == [5, 6, 6]
    assert all(len(v["runs"]) == 3 and all(r.startswith("hospitals-") for r in v["runs"]) for v in listed)
    assert {h["what"] for h in listed[0]["history"]} == {"gnmax"}

    ledger = tmp_path / "nodes" / "hospital_a" / "hospital_a.sqlite"
    ledger.unlink()  # a fresh budget, by deleting it?
    code, err = run(config, tmp_path, capsys, monkeypatch)
    (line,) = [line for line in err.splitlines() if line.startswith("conclave:")]  # stderr also has progress bars
    assert code == 2 and f"owner hospital_a: ledger {ledger} is damaged: it is missing, but its record" in line, line
    assert "says it held 5 entries" in line and not ledger.exists()


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
