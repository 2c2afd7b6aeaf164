"""``conclave plan``: every shipped run config priced from the config alone, the guarantee a run
would state, what the budget admits (checked against a real ledger), and the warnings."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conclave.cluster.cli import main as cli_main
from conclave.cluster.config import load_yaml
from conclave.cluster.plan_command import make_plan
from conclave.cluster.api import TeacherStudent
from conclave.cluster.pipelines import load_pipeline

ROOT = Path(__file__).resolve().parents[2]
RUN_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("tune-"))
SWEEP = ROOT / "configs" / "tune-digits-teachers.yaml"

# Plans every config given, in one process started in an empty folder (so the configs' relative
# data paths lead nowhere), and reports each exit status and output, every file opened meanwhile,
# and which heavy modules were imported.
PLAN_ALL = """
import contextlib, io, json, sys
opened = []
sys.addaudithook(lambda event, args: opened.append(args[0]) if event == "open" and args
                 and isinstance(args[0], str) else None)
from conclave.cluster.cli import main
report = {"plans": {}}
for path in sys.argv[2:]:
    out, err, start = io.StringIO(), io.StringIO(), len(opened)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", path, "--json"])
    report["plans"][path] = {"code": code, "out": out.getvalue(), "err": err.getvalue(), "opened": opened[start:]}
report["modules"] = sorted(m for m in ("torch", "ray", "opacus") if m in sys.modules)
with open(sys.argv[1], "w") as f:
    json.dump(report, f)
"""


@pytest.fixture(scope="module")
def planned_in_isolation(tmp_path_factory) -> dict:
    empty = tmp_path_factory.mktemp("nowhere")
    report_file = tmp_path_factory.mktemp("report") / "report.json"
    result = subprocess.run([sys.executable, "-c", PLAN_ALL, str(report_file), *map(str, RUN_CONFIGS), str(SWEEP)],
                            cwd=empty, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return {**json.loads(report_file.read_text()), "cwd": empty}


def test_plan_imports_neither_torch_nor_ray(planned_in_isolation):
    assert planned_in_isolation["modules"] == []


@pytest.mark.parametrize("config", RUN_CONFIGS, ids=[p.stem for p in RUN_CONFIGS])
def test_plan_prices_every_shipped_run_config_without_touching_data(planned_in_isolation, config):
    plan = planned_in_isolation["plans"][str(config)]
    assert plan["code"] == 0, plan["err"]
    data_places = [planned_in_isolation["cwd"], ROOT / "examples", ROOT.parent / "shared" / "data", ROOT / "data"]
    opened = {Path(planned_in_isolation["cwd"], p).resolve() for p in plan["opened"]}
    assert config.resolve() in opened  # the hook saw the config being read
    touched = [p for p in opened if any(p.is_relative_to(Path(place).resolve()) for place in data_places)]
    assert touched == [], "plan opened data files"
    printed = json.loads(plan["out"])
    pipeline = load_pipeline(load_yaml(config))
    # What privacy.json would state: the pipeline's own planned work, through the run's own guarantee.
    expected = pipeline.guarantee().as_dict()
    assert printed["guarantee"]["epsilon"] == pytest.approx(expected["epsilon"], rel=1e-12) or \
        printed["guarantee"]["epsilon"] == "inf" == str(expected["epsilon"])
    assert printed["guarantee"]["basis"] == expected["basis"] and printed["pipeline"] == pipeline.name
    assert printed["table"][0]["configured"] and len(printed["table"]) >= 1


def test_plan_refuses_a_sweep_in_one_line(planned_in_isolation):
    plan = planned_in_isolation["plans"][str(SWEEP)]
    assert plan["code"] == 2 and plan["out"] == ""
    assert plan["err"].count("\n") == 1 and "sweep" in plan["err"] and "run config" in plan["err"]


def test_a_bad_config_is_one_line_and_status_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"pipeline": "teacher_student", "teachers": {"count": 0}}))
    assert cli_main(["plan", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "teachers.count" in err


def _plan(raw: dict, tmp_path: Path) -> dict:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return dataclasses.asdict(make_plan(str(path), load_pipeline(raw)))


def test_what_the_budget_admits_is_what_a_real_ledger_admits(tmp_path):
    config = load_pipeline(load_yaml(ROOT / "configs" / "hospitals.yaml")).config
    plan = _plan(load_yaml(ROOT / "configs" / "hospitals.yaml"), tmp_path)
    ledger = config.privacy.open_ledger(tmp_path / "ledger.sqlite", config.planned())  # as the run opens it
    one_answer, answered = config.planned(1), 0
    while ledger.can_afford(one_answer):
        ledger.charge(one_answer)
        answered += 1
    ledger.close()
    assert plan["table"][0]["fits"] == answered > config.student.queries
    assert plan["unit"] == "answers" and plan["counts"]["teachers"] == 30 and plan["counts"]["records"] == 299
    epsilons = [row["epsilon"] for row in plan["table"]]
    assert epsilons[1] > epsilons[0] > epsilons[2] > epsilons[3]  # σ ×0.75, ×1.5, ×2


def test_the_runs_an_owners_lifetime_budget_pays_for_are_what_its_real_ledger_admits(tmp_path):
    from conclave.privacy.accounting.owner_policy import OwnerBudget
    from tests.owner_ledgers import opened

    raw = load_yaml(ROOT / "configs" / "hospitals.yaml")
    plan = _plan(raw, tmp_path)
    config = load_pipeline(raw).config
    planned = config.planned()
    budget = OwnerBudget(epsilon=20.0, directory=str(tmp_path / "node"))
    ledger = opened("hospital_a", budget, planned, "plan-check")  # a fresh ledger: its order from this plan
    runs = 0
    while ledger.can_afford(planned):  # every run's worst case (all 10 answered, under its ε 5 budget)
        ledger.charge(planned)
        runs += 1
    ledger.close()
    owners = {o["name"]: o for o in plan["counts"]["owners"]}
    assert owners["hospital_a"]["lifetime"] == 20.0 and owners["hospital_a"]["runs_per_lifetime"] == runs == 11


def test_epochs_that_fit_the_budget_match_the_ledger(tmp_path):
    raw = load_yaml(ROOT / "configs" / "hospitals-active.yaml")
    pipeline = load_pipeline(raw)
    config = pipeline.config
    fits = _plan(raw, tmp_path)["table"][0]["fits"]
    assert fits >= config.dpsgd.epochs

    def affordable(epochs: int) -> bool:
        longer = dataclasses.replace(config, dpsgd=dataclasses.replace(config.dpsgd, epochs=epochs))
        ledger = config.privacy.open_ledger(tmp_path / f"ledger-{epochs}.sqlite", pipeline.plan())
        with ledger:
            return ledger.can_afford(pipeline.with_config(longer).plan())

    assert affordable(fits) and not affordable(fits + 1)


@pytest.mark.parametrize("name,unit", [("mnist-gnmax", "answers"), ("digits-active", "epochs")])
def test_without_a_budget_the_configured_plan_fits_exactly(tmp_path, name, unit):
    raw = load_yaml(ROOT / "configs" / f"{name}.yaml")
    plan = _plan(raw, tmp_path)
    assert plan["budget"] is None and plan["unit"] == unit and plan["table"][0]["fits"] == plan["planned"]


def _hospitals_with(mechanism: dict) -> dict:
    raw = load_yaml(ROOT / "configs" / "hospitals.yaml")
    return {**raw, "mechanism": mechanism}


def test_a_threshold_above_the_teachers_is_warned(tmp_path):
    # Above the 30 teachers (the issue: the old default threshold 30 on 20–30 teachers abstained).
    plan = _plan(_hospitals_with({"name": "confident-gnmax",
                                  "params": {"threshold": 40.0, "sigma1": 12.0, "sigma2": 12.0}}), tmp_path)
    (warning,) = [w for w in plan["warnings"] if "threshold" in w]
    assert "133% of the 30 teachers" in warning and "abstain" in warning
    noisy = _plan(_hospitals_with({"name": "gnmax", "params": {"sigma": 45.0}}), tmp_path)
    assert any("sigma 45 is at least the 30 teachers" in w for w in noisy["warnings"])


def test_defaults_are_derived_from_the_declared_counts(tmp_path):
    raw = _hospitals_with({"name": "confident-gnmax", "params": {"sigma1": 12.0, "sigma2": 12.0}})  # one σ: gateways
    config = load_pipeline(raw).config
    # The owners' 10 teachers each, not the benchmark default of 50; the threshold 0.6 × 30.
    resolved = dataclasses.asdict(config)
    assert resolved["teachers"]["count"] == 30 and resolved["mechanism"]["params"]["threshold"] == pytest.approx(18.0)
    assert not [w for w in _plan(raw, tmp_path)["warnings"] if "threshold" in w]
    # The owners decide: a count given beside them (or left from other owners) follows them.
    given = load_pipeline({**raw, "teachers": {**raw["teachers"], "count": 50}}).config
    assert given.teachers.count == 30
    fewer = dataclasses.replace(config, owners=config.owners[:2])
    assert fewer.teachers.count == 20 and make_plan("fewer", TeacherStudent(fewer)).counts.teachers == 20
    demo = load_pipeline({"pipeline": "teacher_student"}).config
    assert demo.teachers.count == 50 and demo.mechanism.params["threshold"] == pytest.approx(30.0)


def test_a_knn_plan_declares_no_teachers_and_charges_every_asked_query():
    config_path = ROOT / "configs" / "mnist-knn.yaml"
    plan = make_plan(str(config_path), load_pipeline(load_yaml(config_path)))
    assert plan.counts.teachers is None and "kNN votes, k 300 of a Poisson sample at rate 0.1" in plan.work
    assert any("every asked query costs the same" in warning for warning in plan.warnings)
