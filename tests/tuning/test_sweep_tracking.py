"""Sweeps logged to MLflow (a real file store, read back with MLflow's client): a sweep that
publishes every trial logs each as a child run of one summary run; a random-repetition sweep
logs one run with the winner and the sweep's guarantee, and nothing that tells how many
trials ran or when they ended."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from conclave.cluster.config import ConfigError, from_dict, load_yaml
from conclave.cluster.tracking import TrackingConfig
from conclave.tuning import report, sweep as sweep_module
from conclave.tuning.config import TuneConfig
from conclave.tuning.sweep import check, run_sweep

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _config(store: Path, **top) -> TuneConfig:
    """configs/tune-digits-sparsity.yaml, shrunk: one epoch of each training, logged to ``store``."""
    raw = load_yaml(CONFIGS / "tune-digits-sparsity.yaml")
    raw["base"]["pretrain"]["epochs"] = raw["base"]["finetune"]["epochs"] = 1
    raw.update(top, tracking={"mlflow": True, "tracking_uri": store.as_uri(), "experiment": "sweep"})
    return from_dict(TuneConfig, raw)


@pytest.fixture
def client(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())


def _runs(client) -> list:
    return client.search_runs([client.get_experiment_by_name("sweep").experiment_id])


def test_a_grid_sweep_logs_each_trial_under_one_summary_run(ray_session, tmp_path, client):
    config = _config(tmp_path / "mlruns", space={"finetune.variants": {"grid": [["classifier"], ["all"]]}})
    summary = run_sweep(config, tmp_path, verbose=0)
    sweep = json.loads((summary.path / "sweep.json").read_text())
    runs = _runs(client)
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
    assert parent.data.params["num_samples"] == "1" and parent.data.params["base.finetune.epochs"] == "1"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {
        "sweep.json", "trials.csv", "accuracy_vs_epsilon.png"}
    # TensorBoard for free: Tune writes each trial's event file under ray/ (tensorboardX)
    assert len(list((summary.path / "ray").rglob("events.out.tfevents.*"))) == 2


def test_a_random_repetition_sweep_logs_the_winner_alone(ray_session, tmp_path, client, monkeypatch):
    config = _config(tmp_path / "mlruns", scheduler={"name": "fifo"},
                     cost={"method": "random-repetition", "eta": 1.0, "gamma": 0.5},
                     space={"finetune.fraction": {"uniform": [0.01, 0.2]}})
    # K = 2, drawn otherwise as the sweep draws it, so that there is a count to hide; the spy
    # keeps the Ray trial ids, which must appear nowhere in MLflow.
    draw = sweep_module.number_of_trials
    monkeypatch.setattr(sweep_module, "number_of_trials", lambda c, p: (2, *draw(c, p)[1:]))
    ray_ids: list[str] = []
    collect = report.collect

    def spy(grid, space):
        rows, finals = collect(grid, space)
        ray_ids.extend(r.trial_id for r in rows)
        return rows, finals

    monkeypatch.setattr(report, "collect", spy)
    summary = run_sweep(config, tmp_path, verbose=0)
    assert len(ray_ids) == 2
    folder = summary.path
    sweep = json.loads((folder / "sweep.json").read_text())
    (run,) = _runs(client)  # no run per trial
    data = run.data
    assert data.metrics["guarantee.epsilon"] == pytest.approx(sweep["tuning_cost"]["epsilon"])
    assert data.metrics["best.accuracy"] == pytest.approx(sweep["best"]["accuracy"])
    assert data.tags["guarantee.basis"] == "random-repetition" and "Thm. 2" in data.tags["guarantee.statement"]
    assert float(data.params["best.finetune.fraction"]) == pytest.approx(sweep["best"]["values"]["finetune.fraction"])
    # nothing counts the trials: no count, no num_samples, no series longer than the winner's one row
    assert not {"trials", "failed", "num_samples", "seed"} & {*data.metrics, *data.params}
    for key in data.metrics:
        assert len(client.get_metric_history(run.info.run_id, key)) == 1, key
    texts = [*data.params.values(), *data.tags.values(), *data.params, *data.metrics, *data.tags]
    assert not any(i in text for i in ray_ids for text in texts)
    assert not any(re.search(r"_\d{5}\b", text) for text in texts)
    # its times are the results folder's one time, taken before the trials: none says when they ended
    when = int(folder.stat().st_mtime * 1000)
    assert run.info.start_time == run.info.end_time == pytest.approx(when, abs=1)
    assert {m.timestamp for k in data.metrics for m in client.get_metric_history(run.info.run_id, k)} == {
        run.info.start_time}
    run_dir = tmp_path / "mlruns" / run.info.experiment_id / run.info.run_id
    assert len({p.stat().st_mtime for p in [run_dir, *run_dir.rglob("*")]}) == 1
    assert run_dir.stat().st_mtime == pytest.approx(folder.stat().st_mtime)
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {
        "sweep.json", "trials.csv", "accuracy_vs_epsilon.png"}


def test_a_sweep_base_may_not_carry_its_own_tracking_section(tmp_path):
    config = _config(tmp_path / "mlruns")
    base = {**config.base, "tracking": {"mlflow": True}}
    with pytest.raises(ConfigError, match="^base.tracking: a sweep is logged by its own top-level tracking section$"):
        check(dataclasses.replace(config, base=base))
    assert config.tracking == TrackingConfig(True, (tmp_path / "mlruns").as_uri(), "sweep")
