"""A tiny sweep of each kind on digits, through Ray Tune on the session's Ray: each writes its
table and plot, names its best trial, and reports the sweep's ε including the tuning, which
is checked against its formula from the trials' own DP-SGD schedules."""
from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from conclave.cluster.config import ConfigError, from_dict, load_yaml
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp, sampled_gaussian_rdp
from conclave.privacy.accounting.tuning_cost import TruncatedNegativeBinomial, random_repetition_rdp
from conclave.tuning import report, sweep as sweep_module
from conclave.tuning.config import TuneConfig
from conclave.tuning.sweep import check, run_sweep, summary_lines

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _raw(name: str, **changes) -> dict:
    """A shipped configs/tune-digits-*.yaml, shrunk for the test by slash-separated key changes."""
    raw = load_yaml(CONFIGS / name)
    for dotted, value in changes.items():
        node = raw
        *parents, leaf = dotted.split("/")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return raw


def _config(name: str, **changes) -> TuneConfig:
    return from_dict(TuneConfig, _raw(name, **changes))


def _read(summary: report.SweepResult) -> tuple[dict, list[dict]]:
    path = summary.path
    assert (path / "accuracy_vs_epsilon.png").stat().st_size > 10_000
    with (path / "trials.csv").open() as f:
        rows = list(csv.DictReader(f))
    return json.loads((path / "sweep.json").read_text()), rows


def _sparse_trial_rdp(noise_multiplier: float, examples: int, batch: int, epochs: int) -> np.ndarray:
    steps_per_epoch = math.ceil(examples / batch)
    return sampled_gaussian_rdp(DEFAULT_ORDERS, 1 / steps_per_epoch, noise_multiplier, epochs * steps_per_epoch)


def _secure_trial_rdp(noise_multiplier: float, examples: int, batch: int, epochs: int) -> np.ndarray:
    """One trial's steps through the owners' gateways: the secure sum's Poisson-subsampled Skellam, one
    step's curve times the steps (each step is charged on its own in the owners' ledgers)."""
    from conclave.learning.dp_schedule import secure_charge

    steps_per_epoch = math.ceil(examples / batch)
    return epochs * steps_per_epoch * secure_charge(1 / steps_per_epoch, noise_multiplier, 1, "dpsgd").rdp


def _tracked(store: Path) -> dict:
    """A sweep's tracking section: logged to a real MLflow file store at ``store``, read back with
    MLflow's own client (``_mlflow``). The sweeps below are checked for what they log too: one
    sweep for both (suite time)."""
    return {"mlflow": True, "tracking_uri": store.as_uri(), "experiment": "sweep"}


def _mlflow(store: Path):
    """MLflow's client on ``store`` and the sweep's runs there."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.as_uri())
    return client, client.search_runs([client.get_experiment_by_name("sweep").experiment_id])


def _digits_5_to_9_train_size() -> int:
    from conclave.cluster.sparse_finetuning import DataSpec, load_split

    return len(load_split(DataSpec("digits", classes=(5, 6, 7, 8, 9)), 0)[0])


OWNER_RECORDS = 600


def _owner_sparsity_config(tmp_path: Path, **changes) -> TuneConfig:
    """tune-digits-sparsity.yaml with one owner instead of the benchmark's private split: the
    owner holds digits 5–9 as an .npz file, declares its records and asks for a lifetime budget (each
    trial starts its gateway on this machine)."""
    from conclave.learning.data import load_digits

    train, test = load_digits()
    np.savez(tmp_path / "clinic.npz", x=train.x[train.y >= 5], y=train.y[train.y >= 5])
    np.savez(tmp_path / "test.npz", x=test.x[test.y >= 5], y=test.y[test.y >= 5])
    owner = {"name": "clinic", "data": {"format": "npz", "path": str(tmp_path / "clinic.npz"), "label": "y"},
             "records": OWNER_RECORDS,
             "budget": {"epsilon": 50.0, "directory": str(tmp_path / "clinic-node")}}
    raw = _raw("tune-digits-sparsity.yaml", **{
        "base/pretrain/epochs": 1, "base/finetune/epochs": 1, "base/finetune/variants": ["classifier"],
        "scheduler": {"name": "fifo"}, "space": {"finetune.fraction": {"grid": [0.01, 0.1]}}, **changes})
    del raw["base"]["private"]
    raw["base"].update(owners=[owner], test={"format": "npz", "path": str(tmp_path / "test.npz"), "label": "y"})
    return from_dict(TuneConfig, raw)


def test_a_sweep_over_owners_with_asha_composes_every_trial_charges_their_ledgers_and_logs_each_trial(
        ray_session, tmp_path, monkeypatch):
    """One sweep checked three ways (one sweep for all: suite time): what it publishes, what the
    owner's lifetime ledger was charged, and what it logged to MLflow."""
    from conclave.privacy.accounting.ledger import read_ledger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tmp_path / "mlruns"
    config = _owner_sparsity_config(tmp_path, **{
        "base/finetune/epochs": 2, "scheduler": _raw("tune-digits-sparsity.yaml")["scheduler"],  # ASHA
        "space": {"finetune.variants": {"grid": [["classifier"], ["all"]]}}, "tracking": _tracked(store),
    })
    summary = run_sweep(config, tmp_path, verbose=0)
    sweep, rows = _read(summary)
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    assert {r["finetune.variants"] for r in rows} == {"classifier", "all"}
    # composition covers publishing every trial: Tune's own ids and folders stay
    assert sweep["trials"] == 2 and sweep["best"]["trial_id"] in {r["trial_id"] for r in rows}
    assert report.WINNER not in {r["trial_id"] for r in rows} and (summary.path / "ray").is_dir()
    best = sweep["best"]
    assert best["accuracy"] == pytest.approx(max(float(r["accuracy"]) for r in rows), abs=1e-4)
    assert best["accuracy"] > 0.3  # 5 classes: chance is 0.2
    assert best["epsilon_trial"] <= 1.0 + 1e-6  # the ε target of each trial
    # Two trials with the same DP-SGD schedule through the owner's gateway: RDP twice the trial's
    # secure-sum charge, converted at δ (the trials' settings come from a fixed grid).
    sigma = float(rows[0]["noise_multiplier"])
    trial = _secure_trial_rdp(sigma, OWNER_RECORDS, 128, 2)  # the owner's declared records: 5 steps an epoch
    expected, _ = epsilon_from_rdp(DEFAULT_ORDERS, 2 * trial, 1e-5)
    assert sweep["tuning_cost"]["method"] == "composition" and not sweep["tuning_cost"]["free"]
    assert best["epsilon_with_tuning"] == pytest.approx(expected, rel=1e-9)
    assert best["epsilon_with_tuning"] > best["epsilon_trial"]
    assert any("including the tuning" in line for line in summary_lines(summary))

    # Every trial runs the pipeline, so the owner's gateway admits it and its lifetime ledger is
    # charged each trial's every step, as for ``conclave run``.
    owner = read_ledger(tmp_path / "clinic-node" / "clinic.sqlite")
    assert owner.charges == 2 * 10  # two trials of 2 epochs of 5 steps
    np.testing.assert_allclose(owner.spent.rdp, 2 * trial, rtol=1e-9)

    # MLflow: a sweep that publishes every trial logs each as a child run of one summary run
    client, runs = _mlflow(store)
    (parent,) = [r for r in runs if r.data.tags.get("conclave.kind") == "sweep"]
    trials = [r for r in runs if r.data.tags.get("conclave.kind") == "trial"]
    assert len(runs) == 3 and len(trials) == 2  # Ray Tune's MLflow callback: one run per trial
    assert all(t.data.tags["mlflow.parentRunId"] == parent.info.run_id for t in trials)
    assert sorted(t.data.metrics["accuracy"] for t in trials) == pytest.approx(
        sorted(r["accuracy"] for r in sweep["rows"]))
    # the summary run: the sweep's guarantee (the composition of both trials) and its winner
    assert parent.data.metrics["guarantee.epsilon"] == pytest.approx(sweep["tuning_cost"]["epsilon"])
    assert parent.data.metrics["best.accuracy"] == pytest.approx(sweep["best"]["accuracy"])
    assert parent.data.tags["guarantee.basis"] == "composition"
    assert parent.data.params["best.finetune.variants"] == json.dumps(sweep["best"]["values"]["finetune.variants"])
    assert parent.data.params["num_samples"] == "1" and parent.data.params["base.finetune.epochs"] == "2"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {
        "sweep.json", "trials.csv", "accuracy_vs_epsilon.png"}
    # TensorBoard for free: Tune writes each trial's event file under ray/ (tensorboardX)
    assert len(list((summary.path / "ray").rglob("events.out.tfevents.*"))) == 2


def test_sparsity_sweep_with_a_random_number_of_trials_uses_theorem_2_and_logs_the_winner_alone(
        ray_session, tmp_path, caplog, capfd, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tmp_path / "mlruns"
    config = _config("tune-digits-sparsity.yaml", **{
        "base/pretrain/epochs": 1, "base/finetune/epochs": 1, "scheduler": {"name": "fifo"},
        "cost": {"method": "random-repetition", "eta": 1.0, "gamma": 0.5}, "seed": 3,
        "space": {"finetune.fraction": {"uniform": [0.01, 0.2]}}, "tracking": _tracked(store),
    })
    # K = 3 (drawn otherwise as the sweep draws it), so the winner has a place among others to hide;
    # the spy keeps the Ray trial ids, which must then appear nowhere.
    draw = sweep_module.number_of_trials
    monkeypatch.setattr(sweep_module, "number_of_trials", lambda c, p: (3, *draw(c, p)[1:]))
    ray_ids: list[str] = []
    collect = report.collect

    def spy(grid, space):
        rows, finals = collect(grid, space)
        ray_ids.extend(r.trial_id for r in rows)
        return rows, finals

    monkeypatch.setattr(report, "collect", spy)
    caplog.set_level("DEBUG")
    summary = run_sweep(config, tmp_path, verbose=1)  # asks for Tune's table: a hidden sweep prints none
    console = capfd.readouterr()
    sweep, rows = _read(summary)
    assert len(ray_ids) == 3 and all(re.search(r"_0000[0-2]$", i) for i in ray_ids)
    # Only the winner is published, under an opaque name, and nothing says how many trials ran
    # or which one won: not the table, sweep.json, the plot, the summary, the console or the
    # log, not Tune's trial folders, not the files' modification times.
    assert len(rows) == 1 and rows[0]["trial_id"] == sweep["best"]["trial_id"] == report.WINNER
    assert set(sweep) == {"name", "kind", "trials", "failed", "tuning_cost", "delta", "scheduler", "repetitions",
                          "best", "rows"}
    assert sweep["trials"] is None and sweep["failed"] is None
    assert set(sweep["repetitions"]) == {"eta", "gamma", "expected_trials", "published"}
    (winner,) = sweep["rows"]
    assert set(winner["extra"]) == {"epoch", "trained_fraction", "noise_multiplier"}  # what the trial reported
    assert winner["reports"] == len(winner["history"]) == 1  # its own epochs (fifo: every trial runs to the end)
    path = summary.path
    assert not (path / "ray").exists()
    files = [p for p in path.rglob("*") if p.is_file()]
    assert len({p.stat().st_mtime for p in [path, *path.rglob("*")]}) == 1
    lines = summary_lines(summary)
    assert "only the winner published" in lines[0] and f"best: {report.WINNER} (" in lines[1]
    texts = [*lines, console.out, console.err, *(r.getMessage() for r in caplog.records),
             *(p.read_text() for p in files if p.suffix in (".json", ".csv"))]
    assert not any(re.search(r"_\d{5}\b|Number of trials", text) for text in texts)
    everything = [*texts, *(str(p.relative_to(path)) for p in files),
                  *(p.read_bytes().decode("latin-1") for p in files)]
    assert not any(i in text for i in ray_ids for text in everything)
    assert not any("K =" in record.getMessage() or "trials drawn" in record.getMessage() for record in caplog.records)
    trial = _sparse_trial_rdp(float(rows[0]["noise_multiplier"]), _digits_5_to_9_train_size(), 128, 1)
    bound = random_repetition_rdp(DEFAULT_ORDERS, trial, TruncatedNegativeBinomial(1.0, 0.5))
    assert sweep["tuning_cost"]["method"] == "random-repetition"
    assert "Thm. 2" in sweep["tuning_cost"]["statement"]
    assert sweep["best"]["epsilon_with_tuning"] == pytest.approx(epsilon_from_rdp(DEFAULT_ORDERS, bound, 1e-5)[0],
                                                                 rel=1e-9)

    # MLflow: one run, with the winner and the sweep's guarantee
    client, (run,) = _mlflow(store)  # no run per trial
    data = run.data
    assert data.metrics["guarantee.epsilon"] == pytest.approx(sweep["tuning_cost"]["epsilon"])
    assert data.metrics["best.accuracy"] == pytest.approx(sweep["best"]["accuracy"])
    assert data.tags["guarantee.basis"] == "random-repetition" and "Thm. 2" in data.tags["guarantee.statement"]
    assert float(data.params["best.finetune.fraction"]) == pytest.approx(sweep["best"]["values"]["finetune.fraction"])
    # nothing counts the trials: no count, no num_samples, no series longer than the winner's one row
    assert not {"trials", "failed", "num_samples", "seed"} & {*data.metrics, *data.params}
    for key in data.metrics:
        assert len(client.get_metric_history(run.info.run_id, key)) == 1, key
    logged = [*data.params.values(), *data.tags.values(), *data.params, *data.metrics, *data.tags]
    assert not any(i in text for i in ray_ids for text in logged)
    assert not any(re.search(r"_\d{5}\b", text) for text in logged)
    # its times are the results folder's one time, taken before the trials: none says when they ended
    when = int(path.stat().st_mtime * 1000)
    assert run.info.start_time == run.info.end_time == pytest.approx(when, abs=1)
    assert {m.timestamp for k in data.metrics for m in client.get_metric_history(run.info.run_id, k)} == {
        run.info.start_time}
    run_dir = store / run.info.experiment_id / run.info.run_id
    assert len({p.stat().st_mtime for p in [run_dir, *run_dir.rglob("*")]}) == 1
    assert run_dir.stat().st_mtime == pytest.approx(path.stat().st_mtime)
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {
        "sweep.json", "trials.csv", "accuracy_vs_epsilon.png"}


def test_a_sweep_over_owners_refuses_random_repetition(tmp_path):
    config = _owner_sparsity_config(tmp_path, cost={"method": "random-repetition", "eta": 1.0, "gamma": 0.5},
                                    space={"finetune.fraction": {"uniform": [0.01, 0.2]}})
    with pytest.raises(ConfigError, match="charges each owner's ledger"):
        check(config)


def test_diverse_public_sweep_is_free_post_processing_of_one_checkpoint(ray_session, tmp_path):
    config = _config("tune-digits-diverse.yaml", **{
        "base/dpsgd/epochs": 2, "base/finetune/epochs": 3,
        "space": {"selection.n_cluster": {"grid": [5, 10]}, "selection.n_each": {"grid": [3]}},
    })
    summary = run_sweep(config, tmp_path, verbose=0)
    sweep, rows = _read(summary)
    assert sorted(int(r["n_labeled"]) for r in rows) == [15, 30]
    release = sweep["release"]
    assert sweep["tuning_cost"]["free"] and sweep["tuning_cost"]["method"] == "free"
    # The sweep costs the checkpoint once: its ledger's ε, whatever the number of trials.
    assert sweep["best"]["epsilon_with_tuning"] == pytest.approx(release["epsilon"], rel=1e-12)
    assert all(float(r["epsilon"]) == pytest.approx(release["epsilon"], abs=1e-4) for r in rows)
    assert Path(release["path"]).is_file()


def test_near_private_sweep_splits_the_epsilon_limit_on_the_simplex(ray_session, tmp_path):
    # One trial keeps the test fast (each runs the whole pipeline); composing several is
    # checked by the sparsity sweeps above.
    config = _config("tune-digits-nearprivate.yaml", **{
        "num_samples": 1, "base/data/num_shards": 1,
        "base/dpsgd/epochs": 2, "base/selection/near_private_epoch": 2,
        "base/finetune/epochs": 3, "space/selection.sizes": {"choice": [[20]]},
    })
    summary = run_sweep(config, tmp_path, verbose=0)
    sweep, rows = _read(summary)
    (row,) = rows
    assert row["status"] == "ok" and row["stage"] == "near_private" and int(row["n_labeled"]) == 20
    shares = [float(row[k]) for k in ("dpsgd.target_epsilon", "selection.epsilon_pca", "selection.epsilon_support")]
    assert sum(shares) == pytest.approx(3.0, abs=1e-5) and min(shares) >= 0.1 - 1e-5
    # the trial composes its three releases in RDP: at most their basic-composition sum
    assert 0 < float(row["epsilon"]) <= 3.0
    # one trial: the sweep's ε is its run ledger's, the same as the pipeline's per-model figure
    assert sweep["tuning_cost"]["method"] == "composition"
    assert sweep["best"]["epsilon_with_tuning"] == pytest.approx(float(row["epsilon"]), abs=1e-4)


def test_teacher_ensemble_sweep_runs_the_pipeline_per_trial(ray_session, tmp_path):
    # One trial keeps the test fast (it trains an ensemble and a student); composing several
    # is checked by the sparsity sweeps above.
    config = _config("tune-digits-teachers.yaml", **{
        "num_samples": 1, "base/teachers/per_actor": 4,  # one teacher actor
        "base/teachers/train/epochs": 3, "base/student/train/epochs": 3,
        "base/student/checkpoints": [20],
        # σ's low enough to answer with 4 teachers, high enough that the worst case of one
        # batch of 40 queries stays under the ε limit of 20 (else the ledger refuses it)
        "space": {"teachers.count": {"choice": [4]}, "mechanism.params.threshold_fraction": {"choice": [0.5]},
                  "mechanism.params.sigma1": {"choice": [4.0]}, "mechanism.params.sigma2": {"choice": [5.0]},
                  "student.queries": {"choice": [40]}},
    })
    summary = run_sweep(config, tmp_path, verbose=0)
    sweep, rows = _read(summary)
    (row,) = rows
    assert row["status"] == "ok" and int(row["teachers.count"]) == 4 and int(row["asked"]) == 40
    assert 0 < int(row["answered"]) <= 40
    assert 0 < float(row["epsilon"]) <= 20.0  # under the ledger's limit
    # one trial: the sweep's ε is the trial's ledger (its planned worst case composed in RDP)
    assert sweep["best"]["epsilon_with_tuning"] <= float(row["epsilon"]) + 1e-4


@pytest.mark.parametrize("changes,message", [
    ({"scheduler": {"name": "asha"}}, "asha needs trials that report every epoch"),
    ({"cost": {"method": "random-repetition"}}, "charges differ"),
    ({"space": {"teachers.cuont": {"choice": [4]}}}, "unknown key"),
    ({"base/pipeline": "sparse_finetune"}, "runs the 'teacher_student' pipeline"),
])
def test_teacher_sweeps_refuse_what_their_trials_cannot_do(changes, message):
    with pytest.raises(ConfigError, match=message):
        check(_config("tune-digits-teachers.yaml", **changes))


@pytest.mark.parametrize("changes,message", [
    ({"cost": {"method": "random-repetition"}}, "no grid"),
    ({"cost": {"method": "random-repetition"}, "scheduler": {"name": "fifo"},
      "space": {"finetune.target_epsilon": {"choice": [0.5, 1.0]}}}, "same privacy cost"),
    ({"space": {"pretrain.epochs": {"choice": [1, 2]}}}, "prepared once"),
])
def test_sparsity_sweeps_refuse_unsound_random_repetition_and_swept_fixed_keys(changes, message):
    with pytest.raises(ConfigError, match=message):
        check(_config("tune-digits-sparsity.yaml", **changes))


def test_hidden_sweeps_discard_what_ray_prints_and_restore_its_log_handler(ray_session, capfd):
    # Ray's handlers keep the stderr they were made with: watch them through a buffer of ours.
    handlers = [h for h in logging.getLogger("ray").handlers if isinstance(h, logging.StreamHandler)]
    watched = io.StringIO()
    originals = [h.setStream(watched) for h in handlers]
    try:
        with sweep_module._console_discarded():
            print("Number of trials 3")
            logging.getLogger("ray.tune.tune").error("Trials did not complete: [run_trial_abcde_00002]")
        logging.getLogger("ray.tune.tune").warning("after the sweep")
    finally:
        for handler, original in zip(handlers, originals):
            handler.setStream(original)
    console = capfd.readouterr()
    assert "Number of trials" not in console.out + console.err
    assert "after the sweep" in watched.getvalue() and "_00002" not in watched.getvalue()


SEEDED = {"budget": None, "delta": 1e-5, "insecure_noise_seed": 3}
RANDOM_REPETITION = {"scheduler": {"name": "fifo"}, "cost": {"method": "random-repetition"},
                     "space": {"finetune.fraction": {"uniform": [0.01, 0.2]}}}


@pytest.mark.parametrize("name,changes,message", [
    ("tune-digits-sparsity.yaml", {**RANDOM_REPETITION, "base/privacy": SEEDED},
     r"^base\.privacy\.insecure_noise_seed: tuning draws noise from OS entropy only; remove the seed$"),
    ("tune-digits-sparsity.yaml", {"base/privacy": SEEDED}, "base.privacy.insecure_noise_seed"),
    ("tune-digits-teachers.yaml", {"base/privacy": SEEDED}, "base.privacy.insecure_noise_seed"),
    ("tune-digits-diverse.yaml", {"space/privacy.insecure_noise_seed": {"choice": [None, 3]}},
     "space: privacy.insecure_noise_seed cannot be swept"),
])
def test_sweeps_refuse_reproducible_noise(name, changes, message):
    with pytest.raises(ConfigError, match=message):
        check(_config(name, **changes))


def test_conclave_tune_refuses_a_seeded_sweep_before_ray_starts(tmp_path, capsys, monkeypatch):
    import conclave.cluster.ray_runtime as ray_runtime
    from conclave.cluster.cli import main

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started for a refused sweep")

    monkeypatch.setattr(ray_runtime, "start_ray", no_ray)
    seeded = tmp_path / "seeded.yaml"
    raw = _raw("tune-digits-sparsity.yaml", **{**RANDOM_REPETITION, "base/privacy": SEEDED})
    seeded.write_text(yaml.safe_dump(raw))
    assert main(["tune", str(seeded), "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("conclave: base.privacy.insecure_noise_seed: ")
    assert not (tmp_path / "tune-digits-sparsity").exists()


def test_diverse_public_sweeps_refuse_sweeping_what_the_checkpoint_was_trained_with():
    with pytest.raises(ConfigError, match=r"\['privacy.delta'\] are prepared once"):
        check(_config("tune-digits-diverse.yaml", **{"space/privacy.delta": {"choice": [1e-5, 1e-6]}}))


def test_conclave_tune_rejects_a_bad_config_with_status_2(tmp_path, capsys):
    from conclave.cluster.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "tune-digits-teachers.yaml").read_text().replace("kind: teacher_ensemble",
                                                                                 "kind: ensemble"))
    assert main(["tune", str(bad), "--results-dir", str(tmp_path)]) == 2
    assert "kind" in capsys.readouterr().err
