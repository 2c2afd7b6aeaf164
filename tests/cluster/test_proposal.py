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
from conclave.cluster.pipelines import load_pipeline
from conclave.cluster.proposal import (
    CHOICES, DPSGD, DPSGD_RECORDS_PER_PARAMETER, LOCALITY, SOURCES, VOTE_MARGIN, ProposalError, PublicFigures, choose,
    cluster_sizes, dpsgd_model, load_config, model_parameters, propose, proposed_config, proposed_name, render,
    smallest_sigma, teacher_counts,
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
                        "records": records, "budget": {"epsilon": 10.0, "delta": 1e-5}} for i in range(owners)],
            "public": {"format": "csv", "path": str(frames["public"])},
            "test": {"format": "csv", "path": str(frames["test"]), "label": "label"},
            "privacy": {"budget": 4.0, "delta": 1e-5}}


def planned_fits(raw: dict, epsilon: float) -> bool:
    """The planned work of config ``raw`` (as its pipeline plans it) is within ``epsilon`` and the run's
    own filter admits all of it."""
    pipeline = load_pipeline(raw)
    planned = pipeline.plan()
    budget = pipeline.config.privacy.budget_filter(planned)
    admitted = budget is None or budget.admits(float(planned.rdp[order_index(budget.order, planned.orders)]),
                                               planned.extra_delta)
    return worst_case_guarantee(planned, pipeline.config.privacy.delta).epsilon <= epsilon and admitted


def figures(records: int, classes: int = 6, width: int = 15, epsilon: float = 4.0, table: bool = True,
            pool: int = 600) -> PublicFigures:
    return PublicFigures((("a", records // 2), ("b", records - records // 2)), classes, pool, table, width, epsilon,
                         1e-5, 1024, True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    return tiny_table(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def proposals(tiny) -> dict:
    return {choice: propose(tiny, choice) for choice in CHOICES}


def lowered(raw: dict, choice: str) -> dict:
    """``raw`` with its noise a tenth lower (the mechanism's σ's, or DP-SGD's noise multiplier)."""
    if choice == DPSGD:
        return {**raw, "dpsgd": {**raw["dpsgd"], "noise_multiplier": raw["dpsgd"]["noise_multiplier"] * 0.9}}
    params = raw["mechanism"]["params"]
    return {**raw, "mechanism": {"name": raw["mechanism"]["name"],
                                 "params": {k: v * 0.9 if k.startswith("sigma") else v for k, v in params.items()}}}


@pytest.mark.parametrize("choice", CHOICES)
def test_each_proposal_is_a_valid_config_whose_planned_guarantee_fits_the_budget(tiny, proposals, choice):
    proposal = proposals[choice]
    raw = proposed_config(tiny, proposal.sections)  # as `conclave run` reads it
    config = load_config(raw)
    assert planned_fits(raw, 4.0)
    assert proposal.guarantee.epsilon <= 4.0 and proposal.planned_worst_case <= 4.0 and proposal.guarantee.sound
    assert config.name == f"tiny-{choice}-proposed" and config.privacy.budget == 4.0
    assert proposal.reason == f"asked for (--source {choice})"
    if choice == DPSGD:  # every declared record in every step, no label bought: the DP model is the result
        assert raw["pipeline"] == "active_learning" and config.dpsgd.batch_size == 180 == proposal.figures.records
        assert config.selection.strategies == () and config.secure_training and config.model == "quadratic"
        assert "teachers" not in raw["owners"][0]
    else:
        section = {"clusters": config.clusters, "knn": config.knn, "teachers": None}[choice]
        assert (config.records_vote is None) if choice == "teachers" else config.records_vote == section
        if choice != "teachers":  # several owners' records vote only through the secure sum
            assert config.secure
    assert not planned_fits(lowered(raw, choice), 4.0)  # the calibration wastes little


def test_a_table_gets_dpsgd_with_the_richest_model_its_records_pay_for_and_says_why(tiny, proposals):
    proposal = propose(tiny)
    assert proposal.choice == DPSGD and proposal.sections == proposals[DPSGD].sections
    assert "DP-SGD across the owners" in proposal.reason and "84 parameters" in proposal.rule
    assert f"# Why {DPSGD}: {proposal.reason}." in render(tiny, proposal, "tiny.yaml")
    # the quadratic model while the records pay for its parameters, then logistic regression, then votes
    assert dpsgd_model(figures(2400)) == "quadratic"  # 816 parameters: 11.8 records × ε each
    assert dpsgd_model(figures(2400, epsilon=0.5)) == "logistic_regression"  # 1.5 per quadratic parameter
    assert DPSGD_RECORDS_PER_PARAMETER * model_parameters("logistic_regression", 15, 6) > 20 * 4.0
    assert dpsgd_model(figures(20)) is None and choose(figures(20))[0] == "clusters"
    assert choose(figures(60000, classes=10, width=784, table=False))[0] == "clusters"  # images


def test_model_parameters_are_the_built_models():
    from conclave.learning.models import build_model

    for model in ("quadratic", "logistic_regression"):
        built = build_model(model, 6, input_shape=(15,))
        assert model_parameters(model, 15, 6) == sum(p.numel() for p in built.parameters() if p.requires_grad)


def test_public_clusters_ask_every_medoid_in_one_batch(tiny, proposals):
    proposal = proposals["clusters"]
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
    def noise(m: int) -> float:  # σ grows as √m for one release at a fixed ε
        return 1.5 * math.sqrt(m)

    many = figures(2400)
    count, m, fits = cluster_sizes(many, noise)
    votes = many.records * m / count
    assert fits and count == 600 and votes >= VOTE_MARGIN * noise(m) and votes <= 2400 / 6 / LOCALITY
    few = figures(300, pool=120, classes=2)
    count_few, m_few, fits_few = cluster_sizes(few, noise)
    assert fits_few and count_few < 120  # fewer clusters, so each medoid keeps enough votes
    assert cluster_sizes(figures(2400, pool=5000), noise)[0] <= 1024  # one batch of at most server.max_batch
    assert cluster_sizes(figures(20, pool=40), noise)[2] is False  # twenty records cannot outvote the noise


def test_smallest_sigma_is_the_least_noise_that_fits(tiny, proposals):
    proposed = proposed_config(tiny, proposals["clusters"].sections)

    def raw(sigma: float) -> dict:
        return {**proposed, "mechanism": {"name": "public-clusters", "params": {"sigma": sigma}}}

    sigma = smallest_sigma(lambda s: load_pipeline(raw(s)), 2.0, high=1e3)
    assert planned_fits(raw(sigma), 2.0) and not planned_fits(raw(sigma * 0.99), 2.0)
    assert str(sigma) == f"{sigma:.3g}"  # three significant digits, as the YAML shows it
    with pytest.raises(ProposalError, match="no noise up to"):
        smallest_sigma(lambda s: load_pipeline(raw(s)), 1e-6, high=10.0)


def test_only_public_figures_and_a_budget_make_a_proposal(tiny, tmp_path):
    undeclared = {**tiny, "owners": [{k: v for k, v in o.items() if k != "records"} for o in tiny["owners"]]}
    with pytest.raises(ConfigError, match="owner o0: declare its records"):  # the config itself refuses it
        propose(undeclared)
    with pytest.raises(ProposalError, match="privacy.budget"):
        propose({**tiny, "privacy": {"budget": None}})
    unbudgeted = {**tiny, "owners": [{k: v for k, v in o.items() if k != "budget"} for o in tiny["owners"]]}
    with pytest.raises(ProposalError, match=r"^owner o0: no policy on this machine and no budget in the config: .*"
                                            r"\(conclave run refuses it\)$"):  # the gateways a run starts refuse it
        propose(unbudgeted)
    with pytest.raises(ProposalError, match="names no owners"):
        propose(load_yaml(PROJECT_ROOT / "configs" / "digits-teachers.yaml"))
    with pytest.raises(ProposalError, match="teacher_student or active_learning"):
        propose(load_yaml(PROJECT_ROOT / "configs" / "mnist-sparse.yaml"))


@pytest.fixture
def other_consortium(tiny, tmp_path) -> dict:
    """``tiny`` with other owners' files: half the rows, every value a hundred times larger."""
    other = {**tiny, "owners": []}
    for owner in tiny["owners"]:
        path = tmp_path / Path(owner["data"]["path"]).name
        frame = pd.read_csv(owner["data"]["path"]).sample(frac=0.5, random_state=1)
        frame.iloc[:, :-1] = frame.iloc[:, :-1] * 100.0
        frame.to_csv(path, index=False)
        other["owners"].append({**owner, "data": {**owner["data"], "path": str(path)}})
    return other


def test_the_proposal_is_a_function_of_public_figures_alone(tiny, other_consortium, driver_opens):
    """Two consortia whose owners' files differ, with the same declared figures and public tables,
    get the same proposal, and no owner's file is opened to make it."""
    other = other_consortium
    for choice in (None, "clusters", "knn"):
        mine, theirs = propose(tiny, choice), propose(other, choice)
        assert (mine.choice, mine.sections, mine.rule) == (theirs.choice, theirs.sections, theirs.rule)
    owners = {str(Path(owner["data"]["path"]).resolve()) for owner in tiny["owners"] + other["owners"]}
    assert not driver_opens() & owners
    assert str(Path(tiny["public"]["path"]).resolve()) in driver_opens()


def test_an_active_learning_config_gets_a_proposal_too(tiny):
    active = {"pipeline": "active_learning", **{k: v for k, v in tiny.items() if k != "pipeline"},
              "selection": {"strategies": ["random"], "sizes": [5]}}
    proposal = propose(active)  # its own pipeline already: only the sections it sizes
    assert proposal.choice == DPSGD and "pipeline" not in proposal.sections
    assert proposal.sections == {k: v for k, v in propose(tiny).sections.items() if k != "pipeline"}
    assert load_config(proposed_config(active, proposal.sections)).selection.strategies == ()
    clusters = propose(active, "clusters")
    assert load_config(proposed_config(active, clusters.sections)).clusters is not None


def test_one_owner_votes_through_its_gateway_and_its_noise_is_sigma(tmp_path):
    raw = tiny_table(tmp_path, owners=1, records=150)
    proposal = propose(raw, "clusters")
    assert proposal.figures.noise_factor == 1.0  # one party's share carries all the noise
    assert load_config(proposed_config(raw, proposal.sections)).secure
    assert "on the owner's records" in propose(raw).rule


def test_plan_propose_prints_a_complete_config_and_writes_one(tiny, tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny))
    assert cli.main(["plan", str(config), "--propose"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# Proposed by `conclave plan") and "# --- proposed ---\n" in printed
    from_stdout = load_config(yaml.safe_load(printed))
    assert from_stdout.dpsgd.batch_size == 180 and from_stdout.name == "tiny-dpsgd-proposed"
    written = tmp_path / "proposed.yaml"
    assert cli.main(["plan", str(config), "--propose", str(written), "--source", "teachers"]) == 0
    assert "planned guarantee ε" in capsys.readouterr().out
    teachers = load_config(load_yaml(written))
    assert teachers.records_vote is None and teachers.mechanism.name == "gnmax"
    # the plan of each proposal prices it within the budget, as plan's own table shows
    for argv in ([], ["--source", "teachers"]):
        assert cli.main(["plan", str(config), "--propose", str(written), *argv]) == 0
        capsys.readouterr()
        assert cli.main(["plan", str(written), "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["planned_worst_case"] <= 4.0 and plan["table"][0]["fits"] >= plan["planned"]


def test_plan_propose_refuses_in_one_line(tiny, tmp_path, capsys):
    config = tmp_path / "no-budget.yaml"
    config.write_text(yaml.safe_dump({**tiny, "privacy": {"budget": None}}))
    assert cli.main(["plan", str(config), "--propose"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("conclave: --propose fits the noise to privacy.budget") and err.count("\n") == 1


def test_each_choices_proposal_has_a_name_of_its_own(tiny, proposals):
    """Before: every proposal was ``<name>-proposed``, and their runs wrote one results folder."""
    assert {proposals[choice].sections["name"] for choice in CHOICES} == {f"tiny-{c}-proposed" for c in CHOICES}
    assert proposed_name("tiny-clusters-proposed", "knn") == "tiny-knn-proposed"  # a proposal's proposal
    assert proposed_name("tiny-dpsgd-proposed", "clusters") == "tiny-clusters-proposed"
    assert proposed_name("tiny-proposed", "knn") == "tiny-proposed-knn-proposed"  # the user's own name, kept


def test_render_keeps_the_users_keys_and_puts_the_proposal_last(tiny, proposals):
    text = render(tiny, proposals["clusters"], "tiny.yaml")
    before, after = text.split("# --- proposed ---\n")
    assert "owners:" in before and "clusters:" in after and "mechanism:" in after
    assert yaml.safe_load(after).keys() == proposals["clusters"].sections.keys()
    dpsgd = yaml.safe_load(render(tiny, proposals[DPSGD], "tiny.yaml").split("# --- proposed ---\n")[1])
    assert dpsgd["pipeline"] == "active_learning" and dpsgd.keys() == proposals[DPSGD].sections.keys()


DOCUMENTED = [["plan", "configs/hospitals.yaml", "--propose"],
              ["plan", "configs/hospitals.yaml", "--propose", "--source", "clusters"]]


@pytest.mark.parametrize("argv", DOCUMENTED, ids=["plan's choice", "clusters"])
def test_the_documented_proposals_print_configs_that_fit_the_budget(argv, monkeypatch, capsys):
    assert f"conclave {' '.join(argv)} " in (PROJECT_ROOT / "docs" / "main-job.md").read_text()
    monkeypatch.chdir(PROJECT_ROOT)
    assert cli.main(argv) == 0
    raw = yaml.safe_load(capsys.readouterr().out)
    choice = argv[-1] if "--source" in argv else DPSGD
    assert planned_fits(raw, load_yaml(HOSPITALS)["privacy"]["budget"])
    assert load_config(raw).name == f"hospitals-{choice}-proposed"
    if choice == DPSGD:  # 299 records × ε 5 pay for logistic regression's 62 parameters, not the quadratic's 992
        assert raw["model"] == "logistic_regression"


@pytest.mark.slow
@pytest.mark.parametrize("choice", [DPSGD, "clusters"])
def test_conclave_run_takes_each_proposal_it_may_choose_as_the_docs_show(choice, ray_session, run_config_opening,
                                                                          tmp_path, monkeypatch):
    # docs/main-job.md: conclave plan configs/hospitals.yaml --propose hospitals-proposed.yaml, then conclave run it
    monkeypatch.setenv("CONCLAVE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(PROJECT_ROOT)
    proposed = tmp_path / "hospitals-proposed.yaml"
    source = [] if choice == DPSGD else ["--source", choice]
    assert cli.main(["plan", "configs/hospitals.yaml", "--propose", str(proposed), *source]) == 0
    opened = run_config_opening(proposed)
    raw = load_yaml(HOSPITALS)
    assert not opened & {str((PROJECT_ROOT / owner["data"]["path"]).resolve()) for owner in raw["owners"]}
    privacy = json.loads((tmp_path / f"hospitals-{choice}-proposed" / "privacy.json").read_text())
    metrics = json.loads((tmp_path / f"hospitals-{choice}-proposed" / "metrics.json").read_text())
    assert privacy["sound"] and privacy["guarantee"]["epsilon"] <= raw["privacy"]["budget"]
    if choice == DPSGD:  # the DP model is the result: tested, no label bought
        assert metrics["results"] == [] and metrics["labels_bought"] == 0
        assert 0.5 < metrics["checkpoints"][-1]["test_accuracy"] <= 1
    else:
        assert privacy["mechanism"]["name"] == "secure-public-clusters"
        assert metrics["queries_answered"] > 0 and 0 < metrics["student_accuracy"] <= 1
