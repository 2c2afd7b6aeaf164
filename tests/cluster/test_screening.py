"""DP column screening (issue 53): ``conclave plan --propose`` screens a large table's columns before
its quadratic model, and ``conclave run`` runs the proposal through the owners' gateways (started by
the run, real gRPC over mutual TLS, real ledgers): a screening run of logistic regression, admitted and
charged like the steps, then the model on the columns it kept; each owner's ledger holds both runs'
steps and the run's guarantee covers them. A bad column mask on the wire is refused with nothing
charged, and the config refuses screening where it cannot run."""
from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
import yaml

from conclave.cluster import cli
from conclave.cluster.active_learning import ActiveLearningDPSGD
from conclave.cluster.config import ConfigError
from conclave.cluster.pipelines import load_pipeline
from conclave.cluster.proposal import (
    DPSGD, SCREEN_KEEP, SCREEN_STEPS, load_config, propose, proposed_config, render, screens,
)
from conclave.learning.dp_schedule import secure_charge
from conclave.privacy.accounting.guarantee import worst_case_guarantee
from conclave.privacy.accounting.ledger import read_ledger
from conclave.protos import owner_pb2
from tests.cluster.test_proposal import figures, tiny_table

RECORDS, BUDGET, COLUMNS = 400, 4.0, 6  # three owners of 400 rows: 1,200 records, as the proposal screens them


@pytest.fixture(scope="module")
def screened(tmp_path_factory) -> dict:
    """The proposal for a table of 1,200 records at ε 4, written as `conclave plan --propose` does and
    run with `conclave run` (the owners' gateways started by the run, each owner's budget its config's)."""
    folder = tmp_path_factory.mktemp("screening")
    raw = tiny_table(folder, records=RECORDS)
    proposal = propose(raw, DPSGD)
    config = folder / "proposed.yaml"
    config.write_text(render(raw, proposal, "tiny.yaml"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONCLAVE_HOME", str(folder / "home"))
        assert cli.main(["run", str(config), "--results-dir", str(folder / "results")]) == 0
    results = folder / "results" / "tiny-dpsgd-proposed"
    return {"raw": raw, "proposal": proposal, "results": results,
            "privacy": json.loads((results / "privacy.json").read_text()),
            "metrics": json.loads((results / "metrics.json").read_text())}


def test_the_proposal_screens_a_large_tables_columns_within_the_budget(screened):
    proposal, raw = screened["proposal"], screened["raw"]
    section = proposal.sections["dpsgd"]
    assert proposal.sections["model"] == "quadratic"
    assert (section["screen_steps"], section["screen_keep"]) == (SCREEN_STEPS, SCREEN_KEEP)
    assert "first a screening run of 20 steps" in proposal.rule
    # the planned worst case is both runs' steps at the calibrated σ (q = 1), within the budget
    steps, sigma = SCREEN_STEPS + section["epochs"], section["noise_multiplier"]
    whole = worst_case_guarantee(secure_charge(1.0, sigma, steps, "dpsgd"), 1e-5).epsilon
    assert proposal.planned_worst_case == pytest.approx(whole, rel=1e-9) and whole <= BUDGET
    unscreened = proposed_config(raw, {**proposal.sections, "dpsgd": {**section, "screen_steps": 0}})
    assert worst_case_guarantee(load_pipeline(unscreened).plan(), 1e-5).epsilon < whole - 0.3  # the plan has them
    # measured on the proxies: small tables, and tables whose records pay little per parameter, do not screen
    assert screens(figures(2400)) and screens(figures(4000, classes=12, width=30, epsilon=1.0))
    assert not screens(figures(300, classes=2, width=30))  # breast-cancer's shape
    assert not screens(figures(1290, classes=10, width=64))  # digits': 7.9 records × ε per logistic parameter
    assert not screens(figures(60000, classes=10, width=784, table=False))


def test_a_screened_run_charges_each_owner_both_runs_and_its_guarantee_covers_them(screened):
    privacy, metrics, proposal = screened["privacy"], screened["metrics"], screened["proposal"]
    guarantee = privacy["guarantee"]
    assert guarantee["sound"] and guarantee["epsilon"] == pytest.approx(proposal.planned_worst_case, rel=1e-6)
    steps = SCREEN_STEPS + proposal.sections["dpsgd"]["epochs"]
    assert privacy["dpsgd"]["screen_steps"] == SCREEN_STEPS
    kept = privacy["dpsgd"]["screened_columns"]  # public: chosen from the screening run's DP model
    assert kept and kept == sorted(set(kept)) and set(kept) <= set(range(COLUMNS))
    for owner, account in privacy["owners"].items():  # each step of both runs, charged at its gateway
        assert account["spent"]["charges"] == steps and account["spent"]["charges_before_run"] == 0, owner
        assert account["spent"]["epsilon"] == pytest.approx(guarantee["epsilon"], rel=1e-6), owner
    coordinator = read_ledger(screened["results"] / "ledger.sqlite")  # its view: each run before its first step
    assert coordinator.charges == 2 and set(coordinator.by_label) == {"dpsgd-screening", "dpsgd"}
    last = metrics["checkpoints"][-1]  # its model reads the kept columns: its ε includes the screening
    assert last["epsilon"] == pytest.approx(guarantee["epsilon"], rel=1e-6)
    assert last["test_accuracy"] > 0.6


def _admit(config, keep: list[bool]) -> owner_pb2.AdmitRequest:
    from conclave.cluster.active_learning import public_side
    from conclave.cluster.gateway.client import reading_message

    public = public_side(config, np.random.default_rng(0))
    standardiser = owner_pb2.Standardiser(mean=public.standardiser.mean.tolist(),
                                          scale=public.standardiser.scale.tolist(), keep=keep)
    terms = owner_pb2.DpsgdTerms(model="quadratic", max_grad_norm=1.0, noise_multiplier=12.7, sample_rate=1.0,
                                 steps=2, parties=[owner.name for owner in config.owners], records=3 * RECORDS,
                                 standardiser=standardiser)
    return owner_pb2.AdmitRequest(run=f"keep-{len(keep)}-{sum(keep)}", mechanism="dpsgd",
                                  classes=list(public.classes), dpsgd=terms, reading=reading_message(public.reading))


def test_a_bad_column_mask_is_refused_at_the_gateway_with_nothing_charged(screened, tmp_path, monkeypatch):
    from conclave.cluster.active_gateways import coordinator_tls
    from conclave.cluster.gateway.client import OwnerGateway
    from conclave.cluster.gateway.local import LocalGateways
    from conclave.protos import owner_pb2_grpc
    from tests.gateways import channel_to

    monkeypatch.setenv("CONCLAVE_HOME", str(tmp_path / "home"))
    config = load_config(proposed_config(screened["raw"], screened["proposal"].sections))
    with LocalGateways.start(config.owners, cpus_per_actor=1.0) as local:
        tls, address = coordinator_tls(local.gateways), local.addresses["o0"]
        gateway = OwnerGateway(address, tls)
        with channel_to(address, tls) as channel:
            stub = owner_pb2_grpc.OwnerStub(channel)
            for keep in ([True] * (COLUMNS - 1), [False] * COLUMNS):  # a flag short; none kept
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Admit(_admit(config, keep), timeout=60)
                details = refused.value.details()
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
                assert "dpsgd.standardiser.keep" in details and "\n" not in details, details
            assert stub.Admit(_admit(config, [True, False] * (COLUMNS // 2)), timeout=60).planned_epsilon > 0
        assert gateway.budget().charges == 0  # admitted or refused, nothing was charged
        gateway.close()


def test_screening_settings_are_checked_in_one_line(screened, tmp_path):
    for settings, words in (({"screen_steps": -1}, "dpsgd.screen_steps must be >= 0"),
                            ({"screen_keep": 0.0}, "dpsgd.screen_keep must be in (0, 1]"),
                            ({"screen_keep": 1.5}, "dpsgd.screen_keep must be in (0, 1]")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            ActiveLearningDPSGD(**settings)
    raw = {**screened["raw"], "pipeline": "active_learning", "dpsgd": {"screen_steps": 5}}
    assert load_config(raw).dpsgd.screen_steps == 5
    benchmark = {"pipeline": "active_learning", "dpsgd": {"screen_steps": 5}}  # no owners: no gateways to screen at
    with pytest.raises(ConfigError, match="dpsgd.screen_steps: screening runs at the owners' gateways") as caught:
        load_pipeline(benchmark)
    assert "\n" not in str(caught.value)
    images = _image_owners(tmp_path)
    with pytest.raises(ConfigError, match="dpsgd.screen_steps: screening keeps a table's columns") as caught:
        load_pipeline({**images, "dpsgd": {"screen_steps": 5}}).validate()
    assert "\n" not in str(caught.value)
    load_pipeline(images).validate()  # the same without screening is valid


def _image_owners(folder) -> dict:
    """An active learning config whose owners hold digit images (npz), with a public pool and test images."""
    from conclave.learning.data import load_digits

    train, test = load_digits()
    paths = {}
    for index, name in enumerate(("o0", "o1", "public", "test")):
        paths[name] = folder / f"{name}.npz"
        rows = slice(index * 100, (index + 1) * 100)
        x, y = (test.x[:100], test.y[:100]) if name == "test" else (train.x[rows], train.y[rows])
        np.savez(paths[name], x=x, y=y.astype(str))
    owners = [{"name": name, "data": {"format": "npz", "path": str(paths[name]), "label": "y"}, "records": 100,
               "budget": {"epsilon": 10.0, "delta": 1e-5}} for name in ("o0", "o1")]
    return {"pipeline": "active_learning", "name": "images", "owners": owners,
            "public": {"format": "npz", "path": str(paths["public"])},
            "test": {"format": "npz", "path": str(paths["test"]), "label": "y"},
            "selection": {"strategies": []}, "privacy": {"budget": 4.0, "delta": 1e-5}}


def test_the_proposed_config_reads_as_written(screened):
    written = yaml.safe_load(render(screened["raw"], screened["proposal"], "tiny.yaml"))
    config = load_config(written)
    assert config.dpsgd.screen_steps == SCREEN_STEPS and config.dpsgd.screen_keep == SCREEN_KEEP
