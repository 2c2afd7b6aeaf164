"""`conclave run --mlflow`: what an owners' run logs, the tracking section and the flag, and each
way tracking fails before a run. A real small run logged to the default SQLite store and read
back with MLflow's own client is checked with the main job's end-to-end run
(test_teacher_student_pipeline.py: one run for both)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from conclave.cluster.cli import main as cli_main
from conclave.cluster.tracking import INSTALL_HINT, TrackingConfig, from_section, with_flag

# A very small teacher/student run on digits (the plumbing, not a privacy level).
TINY = {
    "pipeline": "teacher_student",
    "name": "tracked",
    "seed": 1,
    "data": {"name": "digits", "public_size": 200},
    "teachers": {"count": 10, "model": "digits_cnn", "train": {"epochs": 10, "batch_size": 32, "lr": 0.003}},
    "mechanism": {"name": "confident-gnmax", "params": {"threshold": 6.0, "sigma1": 3.0, "sigma2": 2.0}},
    "privacy": {"budget": 1000.0, "delta": 1.0e-5},
    "student": {"queries": 80, "batch_size": 40, "checkpoints": [40],
                "model": "digits_cnn", "train": {"epochs": 15, "batch_size": 32, "lr": 0.003}},
}


def _client(results: Path):
    """MLflow's own client on the default store, as docs/cluster-and-tuning.md reads it: no switch to set."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")


def test_an_owners_run_logs_each_owners_lifetime_spend_and_no_data_keys_it_did_not_read(tmp_path):
    from conclave.cluster.pipelines import load_pipeline
    from conclave.cluster.tracking import MlflowLog

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "hospitals.yaml").read_text())
    raw.pop("tracking", None)
    pipeline = load_pipeline(raw)
    folder = tmp_path / "results" / "hospitals"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(pipeline.as_dict(), default=str))
    (folder / "metrics.json").write_text(json.dumps({"student_accuracy": 0.8}))
    account = {"guarantee": {"epsilon": 20.0}, "spent": {"epsilon": 4.5, "charges": 3}}
    (folder / "privacy.json").write_text(json.dumps({
        "guarantee": {"epsilon": 5.0, "delta": 1e-5, "basis": "renyi-filter", "sound": True,
                      "neighbouring": "add-remove"},
        "owners": {"hospital_a": account, "hospital_b": {**account, "spent": {"epsilon": 1.5, "charges": 1}}}}))
    tracker = MlflowLog(TrackingConfig(mlflow=True), tmp_path / "results", "hospitals")
    run_id = tracker.log_run(folder, "hospitals", 1_000.0, pipeline.unused_settings())
    run = _client(tmp_path / "results").get_run(run_id)
    metrics, params = run.data.metrics, run.data.params
    assert metrics["owners.hospital_a.epsilon_spent"] == 4.5 and metrics["owners.hospital_b.epsilon_spent"] == 1.5
    assert metrics["owners.hospital_a.lifetime_epsilon"] == 20.0 and metrics["owners.hospital_b.charges"] == 1
    assert not [key for key in params if key.startswith("data.") and key != "data.features"]
    assert "hospital_a" in params["owners"] and any(key.startswith("public.") for key in params)
    assert run.info.start_time == run.info.end_time == 1_000_000


def test_the_tracking_section_names_the_store_and_the_experiment(tmp_path):
    section = {"mlflow": True, "tracking_uri": (tmp_path / "store").as_uri(), "experiment": "hospitals"}
    assert from_section(section) == TrackingConfig(True, section["tracking_uri"], "hospitals")
    assert from_section(None) == TrackingConfig()
    # the flag turns tracking on and, with a URI, overrides the section's
    assert with_flag(TrackingConfig(), True) == TrackingConfig(mlflow=True)
    assert with_flag(from_section(section), "http://127.0.0.1:5000").tracking_uri == "http://127.0.0.1:5000"
    assert with_flag(from_section(section), None) == from_section(section)


def test_a_bad_tracking_section_is_refused_before_the_run(tmp_path, capsys):
    config_file = tmp_path / "bad.yaml"
    config_file.write_text(yaml.safe_dump({**TINY, "tracking": {"mlflow": True, "uri": "file:/x"}}))
    assert cli_main(["run", str(config_file), "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.tracking: unknown key(s) ['uri']" in err
    assert not (tmp_path / "tracked").exists()


def test_tracking_without_mlflow_installed_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # how Python sees a package that is not installed
    assert cli_main(["demo", "--results-dir", str(tmp_path), "--mlflow"]) == 2
    assert capsys.readouterr().err == f"conclave: {INSTALL_HINT}\n"
    assert "pip install 'conclave-ray[tracking]'" in INSTALL_HINT
    assert not any(tmp_path.iterdir())


def test_an_unreachable_tracking_server_fails_before_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    assert cli_main(["demo", "--results-dir", str(tmp_path), "--mlflow", "http://127.0.0.1:9"]) == 6
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("conclave: MLflow at http://127.0.0.1:9: ")
    assert not any(tmp_path.iterdir())  # nothing ran, nothing recorded


def test_ctrl_c_while_the_tracking_store_opens_is_one_line_and_nothing_runs(tmp_path, capsys, monkeypatch):
    """Opening the store imports MLflow and may wait on a server: a Ctrl-C then was a traceback."""
    from conclave.cluster import run_command

    def interrupted(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_command, "MlflowLog", interrupted)
    assert cli_main(["demo", "--results-dir", str(tmp_path), "--mlflow"]) == 130
    assert capsys.readouterr().err == "conclave: interrupted while opening the tracking store; nothing ran\n"
    assert not any(tmp_path.iterdir())
