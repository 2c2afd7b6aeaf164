"""Owners in the DP-SGD pipelines: in active learning and in sparse fine-tuning each owner's gateway
(started on this machine by the run) holds its file and answers every step of one DP-SGD model on the
schedule of the declared sizes, charging its owner's ledger first; the driver reads only public files;
what cannot run fails before anything is charged, in one line."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import yaml

from conclave.cluster.config import ConfigError, load_yaml
from conclave.cluster.pipelines import load_pipeline
from tests.conftest import PROJECT_ROOT

ACTIVE = PROJECT_ROOT / "configs" / "hospitals-active.yaml"
DATA = PROJECT_ROOT / "examples" / "hospitals" / "data"


def active(**changes):
    config = load_pipeline(load_yaml(ACTIVE)).config
    return dataclasses.replace(config, **changes)


@pytest.mark.slow
def test_three_hospitals_train_one_dp_model_without_the_driver_reading_their_files(
        ray_session, tmp_path, run_config_opening):
    opened = run_config_opening(ACTIVE)
    owners = {str((DATA / name / "records.csv").resolve()) for name in ("hospital_a", "hospital_b", "hospital_c")}
    assert not owners & opened and str((DATA / "public" / "annotated.csv").resolve()) in opened
    metrics = json.loads((tmp_path / "hospitals-active" / "metrics.json").read_text())
    privacy = json.loads((tmp_path / "hospitals-active" / "privacy.json").read_text())
    assert metrics["shards"]["nodes"] == {}  # no actor of the coordinator's holds an owner's records
    # the schedule of the declared 299 records at batch 30: q = 1/10, 10 steps an epoch, 15 epochs
    assert privacy["dpsgd"]["declared_private_size"] == 299 and privacy["dpsgd"]["gateways"] == 3
    assert privacy["dpsgd"]["sample_rate"] == pytest.approx(0.1)
    for owner, account in privacy["owners"].items():  # each owner's ledger: every step, then NearPrivate's two
        spent = account["spent"]
        assert spent["charges"] - spent["charges_before_run"] == 150 + 2, owner
        assert account["budget_source"]["source"] == "config", owner
    assert metrics["checkpoints"][-1]["test_accuracy"] > 0.75  # majority class: 0.63; runs: 0.94–0.97
    assert privacy["guarantee"]["epsilon"] <= 6.0 and privacy["sound"]
    assert privacy["aggregation"] == "secure" and privacy["trust_model"]["trusted"] == []
    assert {r["strategy"] for r in metrics["results"]} == {"random", "entropy", "diverse_public", "near_private"}


def test_dp_sgd_owners_must_declare_their_records():
    raw = load_yaml(ACTIVE)
    del raw["owners"][1]["records"]
    with pytest.raises(ConfigError, match=r"owner hospital_b: declare its records"):
        load_pipeline(raw)
    raw = load_yaml(ACTIVE)
    raw["data"] = {"name": "mnist"}
    with pytest.raises(ConfigError, match="may only set public_size"):
        load_pipeline(raw)
    raw = load_yaml(ACTIVE)
    raw["data"] = {"features": "hog"}
    with pytest.raises(ConfigError, match="data.features: a gateway reads its owner's records as they are"):
        load_pipeline(raw)


def test_an_unlabeled_pool_for_the_oracle_annotator_fails_before_ray_starts(tmp_path, capsys, monkeypatch):
    import ray

    from conclave.cluster import cli

    raw = load_yaml(ACTIVE)
    raw["public"] = {"format": "csv", "path": "examples/hospitals/data/public/unlabeled.csv"}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(PROJECT_ROOT)
    was_running = ray.is_initialized()
    assert cli.main(["run", str(path), "--results-dir", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("conclave: public/test: public: the oracle annotator reveals the pool's labels")
    assert "\n" not in err and ray.is_initialized() == was_running and not (tmp_path / "results").exists()


def test_a_missing_owner_file_stops_dp_sgd_before_anything_is_charged(tmp_path, monkeypatch):
    from conclave.cluster.pipelines import RunContext
    from conclave.cluster.api import ActiveLearning
    from conclave.cluster.results import RunDirectory
    from conclave.privacy.accounting.ledger import PrivacyLedger, read_ledger
    from conclave.privacy.accounting.owner_policy import OwnerBudget, OwnerRefused

    monkeypatch.chdir(PROJECT_ROOT)
    owners = [dataclasses.replace(owner, budget=OwnerBudget(20.0, directory=str(tmp_path / owner.name)))
              for owner in active().owners]
    owners[2] = dataclasses.replace(owners[2], data=dataclasses.replace(owners[2].data, path=str(tmp_path / "gone.csv")))
    with pytest.raises(OwnerRefused) as err:  # its gateway refuses the run
        ActiveLearning(active(owners=tuple(owners))).run(RunContext("gone", RunDirectory(tmp_path, "gone")))
    assert str(err.value) == f"owner hospital_c: {tmp_path / 'gone.csv'}: no such file or folder"
    with PrivacyLedger.open_existing(tmp_path / "gone" / "ledger.sqlite") as ledger:
        assert ledger.report().charges == 0
    for owner in owners[:2]:  # the others admitted the run: nothing was charged
        ledger = tmp_path / owner.name / f"{owner.name}.sqlite"
        assert not ledger.exists() or read_ledger(ledger).charges == 0


@pytest.fixture
def clinics(tmp_path):
    """Two owners' digits 5–9 as .npz images (written before the driver's opens are recorded), and the
    private task's test set, a third .npz file."""
    from conclave.learning.data import load_digits

    train, test = load_digits()
    private = np.flatnonzero(train.y >= 5)
    names = ("clinic_a", "clinic_b")
    for name, part in zip(names, np.array_split(private, 2)):
        np.savez(tmp_path / f"{name}.npz", x=train.x[part], y=train.y[part])
    wanted = test.y >= 5
    np.savez(tmp_path / "test.npz", x=test.x[wanted], y=test.y[wanted])
    return names


@pytest.mark.slow
def test_sparse_fine_tuning_on_two_owners_image_files(tmp_path, clinics, driver_opens):
    """A public model pre-trained on digits 0–4 is fine-tuned on two owners' images through their
    gateways, which the run starts on this machine. Each owner's ledger is charged every step, and
    composes to the run's guarantee; the driver opens no owner's file."""
    from conclave.cluster.pipelines import RunContext
    from conclave.cluster.api import SparseFinetune
    from conclave.cluster.sparse_finetuning import DPFinetuneConfig, PretrainConfig, SparseConfig, validate
    from conclave.cluster.owners import DataOwner
    from conclave.cluster.results import RunDirectory
    from conclave.learning.data.sources import DataSource
    from conclave.learning.dp_schedule import secure_charge
    from conclave.privacy.accounting.ledger import read_ledger
    from conclave.privacy.accounting.owner_policy import OwnerBudget

    names = clinics
    owners = tuple(DataOwner(name, DataSource("npz", str(tmp_path / f"{name}.npz"), label="y"), records=300,
                             budget=OwnerBudget(50.0, directory=str(tmp_path / name))) for name in names)
    config = validate(SparseConfig(name="clinics", owners=owners,
                                   test=DataSource("npz", str(tmp_path / "test.npz"), label="y"),
                                   pretrain=PretrainConfig(epochs=3),
                                   finetune=DPFinetuneConfig(variants=("classifier",), epochs=3, target_epsilon=2.0)))
    outcome = SparseFinetune(config).run(RunContext("clinics", RunDirectory(tmp_path / "results", "clinics")))
    opened = driver_opens()
    privacy = json.loads((tmp_path / "results" / "clinics" / "privacy.json").read_text())
    variant = outcome.metrics["variants"]["classifier"]
    assert not {str((tmp_path / f"{name}.npz").resolve()) for name in names} & opened
    assert str((tmp_path / "test.npz").resolve()) in opened
    assert outcome.metrics["shards"]["nodes"] == {}  # no actor of the coordinator's holds an owner's records
    assert variant["sample_rate"] == pytest.approx(1 / 5)  # the declared 600 at batch 128: 5 steps an epoch
    assert variant["steps"] == 15 and variant["accuracy"] > 0.4  # five classes: chance is 0.2; runs scored 0.58–0.60
    assert outcome.privacy.sound and outcome.privacy.epsilon <= 2.05  # the target, at δ
    assert privacy["aggregation"] == "secure" and privacy["trust_model"]["trusted"] == []
    one = secure_charge(variant["sample_rate"], variant["noise_multiplier"], 1, "dpsgd")
    for name in names:  # each owner's ledger: one charge per step, at its gateway; together the run's guarantee
        ledger = read_ledger(tmp_path / name / f"{name}.sqlite")
        assert ledger.charges == 15 and set(ledger.by_label) == {"dpsgd"}, name
        np.testing.assert_allclose(ledger.spent.rdp, 15 * one.rdp, rtol=1e-9)
        account = privacy["owners"][name]
        assert account["spent"]["charges"] - account["spent"]["charges_before_run"] == 15, name
        assert account["spent"]["epsilon"] == pytest.approx(privacy["guarantee"]["epsilon"], rel=1e-9), name
        assert account["budget_source"]["source"] == "config", name
