"""``conclave plan CONFIG --propose``: settings from public figures alone, whose planned guarantee
fits the budget, as configs ``conclave run`` takes (``cluster.proposal``)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conclave.cluster import cli
from conclave.cluster.config import ConfigError, load_yaml
from conclave.cluster.proposal import (
    LOCALITY, SOURCES, VOTE_MARGIN, ProposalError, PublicFigures, cluster_sizes, load_config, propose, proposed_config,
    proposed_name, render, smallest_sigma, teacher_counts,
)
from conclave.privacy.accounting.filter import order_index
from conclave.privacy.accounting.guarantee import worst_case_guarantee

PROJECT_ROOT = Path(__file__).resolve().parents[2]
HOSPITALS = PROJECT_ROOT / "configs" / "hospitals.yaml"


def tiny_table(folder: Path, owners: int = 3, records: int = 60, pool: int = 40, classes: int = 3) -> dict:
    """A consortium's config over a small synthetic table: owners' CSVs with declared records, a pool, a test table."""
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=owners * records + 2 * pool, n_features=6, n_informative=4, n_redundant=1,
                               n_classes=classes, random_state=3)
    frames = {}
    for name, (start, stop) in {**{f"o{i}": (i * records, (i + 1) * records) for i in range(owners)},
                                "public": (owners * records, owners * records + pool),
                                "test": (owners * records + pool, owners * records + 2 * pool)}.items():
        frame = pd.DataFrame(x[start:stop], columns=[f"c{i}" for i in range(6)])
        if name != "public":  # the pool has no labels
            frame["label"] = [f"k{label}" for label in y[start:stop]]
        frames[name] = folder / f"{name}.csv"
        frame.to_csv(frames[name], index=False)
    return {"pipeline": "teacher_student", "name": "tiny",
            "owners": [{"name": f"o{i}", "data": {"format": "csv", "path": str(frames[f"o{i}"]), "label": "label"},
                        "records": records} for i in range(owners)],
            "public": {"format": "csv", "path": str(frames["public"])},
            "test": {"format": "csv", "path": str(frames["test"]), "label": "label"},
            "privacy": {"budget": 4.0, "delta": 1e-5}}


def planned_fits(config, epsilon: float) -> bool:
    """The planned work's worst case is within ``epsilon`` and the run's own filter admits all of it."""
    planned = config.planned()
    budget = config.privacy.budget_filter(planned)
    admitted = budget is None or budget.admits(float(planned.rdp[order_index(budget.order, planned.orders)]),
                                               planned.extra_delta)
    return worst_case_guarantee(planned, config.privacy.delta).epsilon <= epsilon and admitted


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    return tiny_table(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def proposals(tiny) -> dict:
    return {source: propose(tiny, source) for source in SOURCES}


@pytest.mark.parametrize("source", SOURCES)
def test_each_proposal_is_a_valid_config_whose_planned_guarantee_fits_the_budget(tiny, proposals, source):
    proposal = proposals[source]
    config = load_config(proposed_config(tiny, proposal.sections))  # as `conclave run` reads it
    assert planned_fits(config, 4.0)
    assert proposal.guarantee.epsilon <= 4.0 and proposal.planned_worst_case <= 4.0 and proposal.guarantee.sound
    assert config.name == f"tiny-{source}-proposed" and config.privacy.budget == 4.0
    section = {"clusters": config.clusters, "knn": config.knn, "teachers": None}[source]
    assert (config.records_vote is None) if source == "teachers" else config.records_vote == section
    if source != "teachers":  # several owners' records vote only through the secure sum
        assert config.secure
    # the calibration wastes little: noise a tenth lower would not fit
    name, params = config.mechanism.name, dict(config.mechanism.params)
    lowered = {key: value * 0.9 if key.startswith("sigma") else value for key, value in params.items()}
    rebuilt = load_config({**proposed_config(tiny, proposal.sections), "mechanism": {"name": name, "params": lowered}})
    assert not planned_fits(rebuilt, 4.0)


def test_public_clusters_by_default_every_medoid_asked_in_one_batch(tiny, proposals):
    proposal = propose(tiny)
    assert proposal.source == "clusters" and proposal.sections == proposals["clusters"].sections
    clusters, student = proposal.sections["clusters"], proposal.sections["student"]
    assert student["queries"] == student["batch_size"] == clusters["count"] <= 40
    assert proposal.sections["mechanism"]["name"] == "public-clusters"


def test_teachers_are_shared_by_declared_records_and_each_learns_from_enough():
    figures = PublicFigures((("a", 1000), ("b", 500), ("c", 20)), classes=3, pool=100, table=True, width=5,
                            epsilon=4.0, delta=1e-5, max_batch=1024, secure=False)
    counts = teacher_counts(figures)
    assert sum(counts) == 1520 // 20 and counts[0] > counts[1] > counts[2] >= 1
    assert teacher_counts(PublicFigures((("a", 2),), 2, 10, True, 5, 4.0, 1e-5, 1024, False)) == [1]
    assert sum(teacher_counts(PublicFigures((("a", 10**6),), 2, 10, True, 5, 4.0, 1e-5, 1024, False))) == 250


def test_cluster_sizes_meet_the_noise_and_locality_conditions_or_say_they_cannot():
    def figures(records: int, pool: int, classes: int = 6) -> PublicFigures:
        return PublicFigures((("a", records // 2), ("b", records - records // 2)), classes, pool, True, 15, 4.0, 1e-5,
                             1024, True)

    def noise(m: int) -> float:  # σ grows as √m for one release at a fixed ε
        return 1.5 * math.sqrt(m)

    many = figures(2400, 600)
    count, m, fits = cluster_sizes(many, noise)
    votes = many.records * m / count
    assert fits and count == 600 and votes >= VOTE_MARGIN * noise(m) and votes <= 2400 / 6 / LOCALITY
    few = figures(300, 120, classes=2)
    count_few, m_few, fits_few = cluster_sizes(few, noise)
    assert fits_few and count_few < 120  # fewer clusters, so each medoid keeps enough votes
    assert cluster_sizes(figures(2400, 5000), noise)[0] <= 1024  # one batch of at most server.max_batch
    assert cluster_sizes(figures(20, 40), noise)[2] is False  # twenty records cannot outvote the noise


def test_smallest_sigma_is_the_least_noise_that_fits(tiny, proposals):
    proposed = proposed_config(tiny, proposals["clusters"].sections)

    def build(sigma: float):
        return load_config({**proposed, "mechanism": {"name": "public-clusters", "params": {"sigma": sigma}}})

    sigma = smallest_sigma(build, 2.0, high=1e3)
    assert planned_fits(build(sigma), 2.0) and not planned_fits(build(sigma * 0.99), 2.0)
    assert str(sigma) == f"{sigma:.3g}"  # three significant digits, as the YAML shows it
    with pytest.raises(ProposalError, match="no noise up to"):
        smallest_sigma(build, 1e-6, high=10.0)


def test_only_public_figures_and_a_budget_make_a_proposal(tiny, tmp_path):
    undeclared = {**tiny, "owners": [{k: v for k, v in o.items() if k != "records"} for o in tiny["owners"]]}
    with pytest.raises(ConfigError, match="owner o0: declare its records"):  # the config itself refuses it
        propose(undeclared)
    with pytest.raises(ProposalError, match="privacy.budget"):
        propose({**tiny, "privacy": {"budget": None}})
    with pytest.raises(ProposalError, match="names no owners"):
        propose(load_yaml(PROJECT_ROOT / "configs" / "digits-teachers.yaml"))
    with pytest.raises(ProposalError, match="teacher_student"):
        propose(load_yaml(PROJECT_ROOT / "configs" / "hospitals-active.yaml"))


def test_the_proposal_reads_no_owners_file(tiny, driver_opens):
    propose(tiny, "knn")
    owners = {str(Path(owner["data"]["path"]).resolve()) for owner in tiny["owners"]}
    assert not driver_opens() & owners
    assert str(Path(tiny["public"]["path"]).resolve()) in driver_opens()


def test_one_owner_votes_through_its_gateway_and_its_noise_is_sigma(tmp_path):
    raw = tiny_table(tmp_path, owners=1, records=150)
    proposal = propose(raw)
    assert proposal.figures.noise_factor == 1.0  # one party's share carries all the noise
    assert load_config(proposed_config(raw, proposal.sections)).secure


def test_plan_propose_prints_a_complete_config_and_writes_one(tiny, tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny))
    assert cli.main(["plan", str(config), "--propose"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# Proposed by `conclave plan") and "# --- proposed ---\n" in printed
    from_stdout = load_config(yaml.safe_load(printed))
    assert from_stdout.clusters is not None and from_stdout.name == "tiny-clusters-proposed"
    written = tmp_path / "proposed.yaml"
    assert cli.main(["plan", str(config), "--propose", str(written), "--source", "teachers"]) == 0
    assert "planned guarantee ε" in capsys.readouterr().out
    teachers = load_config(load_yaml(written))
    assert teachers.records_vote is None and teachers.mechanism.name == "gnmax"
    # the plan of the proposal prices it within the budget, as plan's own table shows
    assert cli.main(["plan", str(written), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["planned_worst_case"] <= 4.0 and plan["table"][0]["fits"] >= plan["planned"]


def test_plan_propose_refuses_in_one_line(tiny, tmp_path, capsys):
    config = tmp_path / "no-budget.yaml"
    config.write_text(yaml.safe_dump({**tiny, "privacy": {"budget": None}}))
    assert cli.main(["plan", str(config), "--propose"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("conclave: --propose fits the noise to privacy.budget") and err.count("\n") == 1


def test_each_sources_proposal_has_a_name_of_its_own(tiny, proposals):
    """Before: every proposal was ``<name>-proposed``, and their runs wrote one results folder."""
    assert {proposals[source].sections["name"] for source in SOURCES} == {f"tiny-{s}-proposed" for s in SOURCES}
    assert proposed_name("tiny-clusters-proposed", "knn") == "tiny-knn-proposed"  # a proposal's proposal
    assert proposed_name("tiny-proposed", "knn") == "tiny-proposed-knn-proposed"  # the user's own name, kept


def test_render_keeps_the_users_keys_and_puts_the_proposal_last(tiny, proposals):
    text = render(tiny, proposals["clusters"], "tiny.yaml")
    before, after = text.split("# --- proposed ---\n")
    assert "owners:" in before and "clusters:" in after and "mechanism:" in after
    assert yaml.safe_load(after).keys() == proposals["clusters"].sections.keys()


DOCUMENTED = [["plan", "configs/hospitals.yaml", "--propose"],
              ["plan", "configs/hospitals.yaml", "--propose", "--source", "teachers"]]


@pytest.mark.parametrize("argv", DOCUMENTED, ids=["clusters", "teachers"])
def test_the_documented_proposals_print_configs_that_fit_the_budget(argv, monkeypatch, capsys):
    assert f"conclave {' '.join(argv)} " in (PROJECT_ROOT / "docs" / "main-job.md").read_text()
    monkeypatch.chdir(PROJECT_ROOT)
    assert cli.main(argv) == 0
    config = load_config(yaml.safe_load(capsys.readouterr().out))
    source = argv[-1] if "--source" in argv else "clusters"
    assert planned_fits(config, load_yaml(HOSPITALS)["privacy"]["budget"])
    assert config.name == f"hospitals-{source}-proposed"


@pytest.mark.slow
def test_conclave_run_takes_the_proposal_as_the_docs_show(ray_session, run_config_opening, tmp_path, monkeypatch,
                                                          capsys):
    # docs/main-job.md: conclave plan configs/hospitals.yaml --propose hospitals-proposed.yaml, then conclave run it
    monkeypatch.setenv("CONCLAVE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(PROJECT_ROOT)
    proposed = tmp_path / "hospitals-proposed.yaml"
    assert cli.main(["plan", "configs/hospitals.yaml", "--propose", str(proposed)]) == 0
    opened = run_config_opening(proposed)
    raw = load_yaml(HOSPITALS)
    assert not opened & {str((PROJECT_ROOT / owner["data"]["path"]).resolve()) for owner in raw["owners"]}
    privacy = json.loads((tmp_path / "hospitals-clusters-proposed" / "privacy.json").read_text())
    metrics = json.loads((tmp_path / "hospitals-clusters-proposed" / "metrics.json").read_text())
    assert privacy["sound"] and privacy["guarantee"]["epsilon"] <= raw["privacy"]["budget"]
    assert privacy["mechanism"]["name"] == "secure-public-clusters"
    assert metrics["queries_answered"] > 0 and 0 < metrics["student_accuracy"] <= 1
