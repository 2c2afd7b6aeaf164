"""The main job end to end (real Ray actors, real gRPC on 127.0.0.1), its configs and its CLI."""
from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from conclave.cluster.cli import main as cli_main
from conclave.cluster.config import ConfigError, from_dict, load_yaml
from conclave.cluster.teaching.aggregation import privacy_section
from conclave.cluster.teaching.config import TeacherStudentConfig
from conclave.cluster.pipelines import DEMO_CONFIG, load_pipeline
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.accounting.rdp import epsilon_from_rdp
from conclave.privacy.mechanisms import build_mechanism

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TEACHER_STUDENT_CONFIGS = ["digits-teachers", "mnist-gnmax", "mnist-lnmax", "mnist-nzc", "mnist-nzc-5teachers",
                           "mnist-gnmax-scatternet", "demo"]

# A smaller demo: 10 teachers on digits, Confident-GNMax, 120 queries (so little noise
# that ε is large: this checks the plumbing and the bookkeeping, not a privacy level).
TINY = {
    "pipeline": "teacher_student",
    "name": "tiny",
    "seed": 1,
    "data": {"name": "digits", "public_size": 200},
    "teachers": {"count": 10, "model": "digits_cnn", "train": {"epochs": 15, "batch_size": 32, "lr": 0.003}},
    "mechanism": {"name": "confident-gnmax", "params": {"threshold": 6.0, "sigma1": 3.0, "sigma2": 2.0}},
    "privacy": {"budget": 1000.0, "delta": 1.0e-5},
    "estimates": {"smooth_sensitivity": True},
    "student": {"queries": 120, "batch_size": 40, "checkpoints": [40],
                "model": "digits_cnn", "train": {"epochs": 25, "batch_size": 32, "lr": 0.003}},
}


def test_cli_run_end_to_end_on_digits_logged_to_mlflow(ray_session, tmp_path, capsys, monkeypatch):
    """One run, checked for its results and for what ``--mlflow`` logged of them (one run for
    both: suite time)."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.chdir(tmp_path)  # MLflow's own default place for artefacts would be ./mlruns
    config_file = tmp_path / "tiny.yaml"
    config_file.write_text(yaml.safe_dump(TINY))
    results = tmp_path / "results"
    assert cli_main(["run", str(config_file), "--results-dir", str(results), "--mlflow"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "student_accuracy" in printed and "queries_answered" in printed and "guarantee ε =" in printed
    assert "mlflow: run " in printed
    assert "smooth-sensitivity estimate ε =" in printed and "(not a DP guarantee)" in printed

    run_dir = results / "tiny"
    for name in ("config.json", "metrics.json", "privacy.json", "student_accuracy.png", "epsilon_spent.png"):
        assert (run_dir / name).is_file(), name
    metrics = json.loads((run_dir / "metrics.json").read_text())
    privacy = json.loads((run_dir / "privacy.json").read_text())
    assert json.loads((run_dir / "config.json").read_text())["teachers"]["count"] == 10

    # The student learned from the teachers: far above chance (0.1) on held-out digits.
    assert metrics["student_accuracy"] > 0.5
    assert metrics["queries_asked"] == 120
    assert 0 < metrics["queries_answered"] <= 120
    assert metrics["label_accuracy"] > 0.7
    assert [p["asked"] for p in metrics["curve"]] == [40, 120]
    assert metrics["teachers"]["count"] == 10 and metrics["teachers"]["actors"] == 2

    # The guarantee: the smaller of the declared budget (1000) and the worst case of the
    # planned work — all 120 queries answered plus the smooth-sensitivity release.
    config = load_pipeline(TINY).config
    planned = config.planned()
    worst = epsilon_from_rdp(planned.orders, planned.rdp, 1e-5)[0]
    guarantee = privacy["guarantee"]
    assert privacy["sound"] and guarantee["basis"] == "worst-case" and guarantee["epsilon"] == pytest.approx(worst)
    assert guarantee["neighbouring"] == "add-remove" and privacy["budget"]["epsilon"] == 1000.0
    assert privacy["queries"] == 120 and privacy["answered"] == metrics["queries_answered"]
    # The realised spend is shown as such; the estimate's release was paid for before the first query.
    assert metrics["curve"][-1]["budget"]["epsilon_spent"] == pytest.approx(privacy["spent"]["epsilon"])
    # the run's guarantee is privacy.json's alone: the curve carries no other (its service's would differ)
    assert not {"guarantee", "sound"} & set(metrics["curve"][-1]["budget"])
    assert privacy["spent"]["epsilon"] <= worst
    assert set(privacy["spent"]["by_label"]) == {"confident-gnmax", "smooth-sensitivity-release"}
    # Only the smooth-sensitivity release of the data-dependent analysis is published, as an estimate.
    (estimate,) = privacy["estimates"]
    assert estimate["name"] == "smooth-sensitivity" and estimate["label"] == "estimate: not a DP guarantee"
    assert estimate["available"] and not estimate["private"]
    assert "smooth_sensitivity" not in estimate and "noise_std" not in estimate
    # Nothing computed from the private votes or the teachers' training leaves.
    assert "clean_vote_accuracy" not in metrics and "mean_last_epoch_loss" not in metrics["teachers"]

    # What --mlflow logged, read back with MLflow's own client on the default store (SQLite beside
    # the runs), as docs/cluster-and-tuning.md reads it: no switch to set.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    logged = run.data.metrics
    assert logged["student_accuracy"] == pytest.approx(metrics["student_accuracy"])
    assert logged["queries_answered"] == metrics["queries_answered"]
    assert logged["guarantee.epsilon"] == pytest.approx(privacy["guarantee"]["epsilon"])
    assert logged["guarantee.delta"] == pytest.approx(1e-5)
    assert run.data.tags["guarantee.basis"] == privacy["guarantee"]["basis"]
    assert run.data.tags["guarantee.sound"] == "true"
    # a list of metrics.json is a series: the student's accuracy at each checkpoint
    history = client.get_metric_history(run.info.run_id, "curve.accuracy")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(
        [p["accuracy"] for p in metrics["curve"]])
    # params: the resolved config, flattened
    assert run.data.params["teachers.count"] == "10" and run.data.params["pipeline"] == "teacher_student"
    assert run.data.params["privacy.budget"] == "1000.0"
    # metrics come from metrics.json (and the guarantee) only: nothing else is logged as a number
    assert {k.split(".")[0] for k in logged} <= set(metrics) | {"guarantee"}
    artefacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "metrics.json", "privacy.json", "student_accuracy.png"} <= artefacts
    assert not any(a.startswith("ledger") for a in artefacts)
    assert run.info.status == "FINISHED" and run.info.start_time == run.info.end_time  # no run time
    assert {m.timestamp for k in logged for m in client.get_metric_history(run.info.run_id, k)} == {
        run.info.start_time}
    assert (results / "mlartifacts").is_dir() and not (tmp_path / "mlruns").exists()
    # the params the run read: no owners' sections in a benchmark-data run
    assert not {"owners", "public", "test", "classes"} & set(run.data.params)


def test_teachers_and_student_learn_on_scattering_features_of_images(ray_session, tmp_path):
    """With data.features the teachers and the student learn on scattering features, and the
    student still asks the aggregator about images (it validates the image shape)."""
    features = {**TINY, "name": "scattering", "data": {**TINY["data"], "features": "scattering"},
                "teachers": {**TINY["teachers"], "model": "scatternet_cnn"},
                "student": {**TINY["student"], "model": "scatternet_cnn"},
                # reproducible noise, as for debugging: the run must say its ε is not sound
                "privacy": {**TINY["privacy"], "insecure_noise_seed": 7}}
    config_file = tmp_path / "scattering.yaml"
    config_file.write_text(yaml.safe_dump(features))
    assert cli_main(["run", str(config_file), "--results-dir", str(tmp_path / "results")]) == 0
    metrics = json.loads((tmp_path / "results" / "scattering" / "metrics.json").read_text())
    privacy = json.loads((tmp_path / "results" / "scattering" / "privacy.json").read_text())
    assert metrics["queries_asked"] == 120 and metrics["queries_answered"] > 0
    assert metrics["label_accuracy"] > 0.7
    assert metrics["student_accuracy"] > 0.5  # chance is 0.1
    assert privacy["sound"] is False and "insecure_noise_seed=7" in privacy["unsound_reasons"][0]
    assert privacy["guarantee"]["sound"] is False


def test_nzc_report_gives_the_sound_unbounded_epsilon_beside_the_papers_claim(tmp_path):
    config = from_dict(TeacherStudentConfig,
                       {"mechanism": {"name": "nzc", "params": {"constant": 1e100, "laplace_scale": 1e10}},
                        "privacy": {"budget": None}})
    mechanism = config.mechanism.build()
    votes = np.array([[200, 50, 0], [120, 118, 12]])
    ledger = config.privacy.open_ledger(tmp_path / "ledger.sqlite", config.planned())
    result = mechanism(votes, np.random.default_rng(0))
    ledger.charge(result.charge.for_records("add-remove", "test"))
    report = privacy_section(config, ledger, votes, result.labels >= 0)
    ledger.close()
    assert report.epsilon == math.inf and report.guarantee.basis == "unbounded" and not report.sound
    assert "no finite guarantee" in report.headline() and "paper-claim estimate" in report.headline()
    privacy = report.as_dict()  # privacy.json
    assert privacy["sound"] is False and privacy["spent"]["epsilon"] == math.inf
    (claim,) = privacy["estimates"]  # the paper's claim, beside the guarantee, labelled
    assert claim["name"] == "paper-claim" and "NOT a valid" in claim["source"]
    assert claim["epsilon"] < 1e-6 and claim["label"] == "estimate: not a DP guarantee"


def test_the_demo_config_file_is_what_conclave_demo_runs_and_the_digits_teachers_are_the_defaults():
    from_file = load_pipeline(load_yaml(CONFIGS / "demo.yaml")).config
    assert from_file == load_pipeline(DEMO_CONFIG).config  # what `conclave demo` runs
    assert from_file.clusters is not None and from_file.mechanism.name == "public-clusters"
    teachers = load_pipeline(load_yaml(CONFIGS / "digits-teachers.yaml")).config
    assert teachers == TeacherStudentConfig(name="digits-teachers")


@pytest.mark.parametrize("name", TEACHER_STUDENT_CONFIGS)
def test_shipped_configs_load_and_validate(name):
    pipeline = load_pipeline(load_yaml(CONFIGS / f"{name}.yaml"))
    config = pipeline.config
    assert pipeline.name == "teacher_student" and config.name == name
    assert config.student.queries <= config.data.public_size


def test_mnist_configs_carry_the_papers_settings():
    configs = {name: load_pipeline(load_yaml(CONFIGS / f"{name}.yaml")).config for name in TEACHER_STUDENT_CONFIGS
               if name.startswith("mnist-")}
    assert configs["mnist-gnmax"].mechanism.build() == build_mechanism("confident-gnmax", threshold=200, sigma1=150, sigma2=40)
    assert configs["mnist-lnmax"].mechanism.build() == build_mechanism("lnmax", laplace_scale=20)
    assert configs["mnist-nzc"].teachers.count == 250 and configs["mnist-nzc-5teachers"].teachers.count == 5
    for name in ("mnist-nzc", "mnist-nzc-5teachers"):
        assert configs[name].student.queries == 9000 and configs[name].privacy.budget is None
    assert all(c.teachers.count == 250 for n, c in configs.items() if n != "mnist-nzc-5teachers")
    # The headline run: the same data and threshold step as mnist-gnmax, on ScatterNet features,
    # under a budget declared in advance, asking the whole pool until the budget refuses.
    gnmax, scatternet = configs["mnist-gnmax"], configs["mnist-gnmax-scatternet"]
    assert scatternet.data == dataclasses.replace(gnmax.data, features="scattering")
    assert scatternet.teachers.model == scatternet.student.model == "scatternet_cnn"
    assert scatternet.privacy.budget == 2.0 and scatternet.student.queries == scatternet.data.public_size
    assert scatternet.mechanism.build() == build_mechanism("confident-gnmax", threshold=200, sigma1=150, sigma2=60)
    assert scatternet.student.semi_supervised is not None and gnmax.student.semi_supervised is not None


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"student": {"querries": 5}}, "querries"),
        ({"teachers": {"count": 0}}, "teachers.count"),
        ({"mechanism": {"name": "gnmax", "params": {"sigma1": 3.0}}}, "sigma1"),
        ({"mechanism": {"name": "nzc", "params": {"constant": 1e100, "laplace_scale": 1e10}}}, "privacy.budget"),
        ({"privacy": {"budget": 1e-5}}, "no RDP budget"),
        ({"estimates": {"smooth_sensitivity": True, "order": 10.0}}, "go together"),
        ({"student": {"queries": 301}}, "public_size"),
        ({"privacy": {"delta": 2.0}}, "delta"),
        ({"data": {"features": "sift"}}, "data.features"),
    ],
)
def test_a_bad_config_is_a_config_error_naming_the_problem(override, named):
    with pytest.raises(ConfigError, match=named):
        load_pipeline({"pipeline": "teacher_student", **override})


def test_cli_reports_a_bad_config_key_without_running(tmp_path, capsys):
    config_file = tmp_path / "bad.yaml"
    config_file.write_text(yaml.safe_dump({"pipeline": "teacher_student", "studnet": {}}))
    assert cli_main(["run", str(config_file), "--results-dir", str(tmp_path)]) == 2
    assert "studnet" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("command", ["run", "serve"])
def test_data_the_driver_cannot_load_fails_in_one_line_before_ray_starts(tmp_path, capsys, command):
    import ray

    config_file = tmp_path / "big-pool.yaml"
    config_file.write_text(yaml.safe_dump({**TINY, "name": "big", "data": {"name": "digits", "public_size": 5000}}))
    argv = [command, str(config_file)]
    argv += ["--results-dir", str(tmp_path)] if command == "run" else ["--ledger", str(tmp_path / "l.sqlite")]
    was_running = ray.is_initialized()
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and "public_size" in err[0] and err[0].startswith("conclave: data:")
    assert ray.is_initialized() == was_running  # nothing was started
    assert not (tmp_path / "l.sqlite").exists()


def _serve_args(*argv: str):
    from conclave.cluster.cli import build_parser

    return build_parser("serve").parse_args(["serve", *argv])


def test_serve_over_tls_answers_outside_clients_and_repeats_answers_after_a_restart(ray_session, tmp_path,
                                                                                   monkeypatch, capsys):
    from conclave.cluster import serve_command
    from conclave.cluster.client import AggregatorClient
    from conclave.learning.data import load_digits
    from tests.certificates import make_certificates

    small = {**TINY, "name": "served", "teachers": {**TINY["teachers"], "count": 5, "train": {"epochs": 5}}}
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(yaml.safe_dump(small))
    certs = make_certificates(tmp_path / "certs")
    args = _serve_args(str(config_file), "--ledger", str(tmp_path / "serve-ledger.sqlite"),
                       "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key))
    _, test = load_digits()
    answers = []
    for _ in range(2):  # the second run restarts on the same ledger: repeats are free and identical
        monkeypatch.setenv("CONCLAVE_TOKEN", "serve-test-token")  # serve takes it out of the environment
        stop, outcome = threading.Event(), []
        thread = threading.Thread(target=lambda: outcome.append(serve_command.main(args, stop)))
        thread.start()
        try:
            address = _wait_for_address(capsys, thread)
            assert address.startswith("127.0.0.1:")
            with AggregatorClient(address, token="serve-test-token", root_cert=certs.ca) as client:
                answers.append((client.label(test.x[:20]), client.budget()))
        finally:
            stop.set()
            thread.join(timeout=60)
        assert outcome == [0]
    (labels, budget), (repeated, after_restart) = answers
    assert labels.shape == (20,) and ((labels >= -1) & (labels < 10)).all()
    assert budget["mechanism"] == "confident-gnmax" and budget["epsilon_spent"] > 0
    assert budget["guarantee"]["basis"] == "renyi-filter" and budget["guarantee"]["epsilon"] == 1000.0
    assert (repeated == labels).all() and after_restart["epsilon_spent"] == budget["epsilon_spent"]
    assert after_restart["cache_hits"] == 20
    # The ledger outlives the server: reopening it restores what was spent, with its budget.
    with PrivacyLedger.open_existing(tmp_path / "serve-ledger.sqlite") as reopened:
        assert reopened.report().epsilon_spent == pytest.approx(budget["epsilon_spent"])
        assert reopened.report().budget.epsilon == 1000.0
        assert len(reopened.answers.read()) == 20


def test_serve_refuses_a_public_host_without_tls_before_starting_anything(tmp_path, capsys):
    from conclave.cluster import serve_command

    config_file = tmp_path / "serve.yaml"
    config_file.write_text(yaml.safe_dump({**TINY, "name": "public"}))
    assert serve_command.main(_serve_args(str(config_file), "--host", "0.0.0.0",
                                          "--ledger", str(tmp_path / "l.sqlite"))) == 2
    assert "TLS" in capsys.readouterr().err and not (tmp_path / "l.sqlite").exists()


def _wait_for_address(capsys, thread: threading.Thread, timeout: float = 300.0) -> str:
    printed = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and thread.is_alive():
        printed += capsys.readouterr().out
        for line in printed.splitlines():
            if line.startswith("aggregator serving on "):
                return line.split()[3]
        time.sleep(0.2)
    raise AssertionError(f"conclave serve printed no address: {printed!r}")


def test_the_non_private_ceiling_trains_the_configs_student_on_every_true_pool_label():
    """The ceiling beside the MNIST rows, here on the digits clusters config: no Ray, no
    aggregator, no private record; its student is the config's, trained by the runs' own path."""
    from conclave.cluster.teaching.student import non_private_ceiling

    config = load_pipeline(load_yaml(CONFIGS / "demo.yaml")).config  # public-cluster votes; its FixMatch: ~30 s
    ceiling = non_private_ceiling(config, progress=False)
    assert ceiling.labelled == config.data.public_size and ceiling.model == "digits_cnn_wide"
    assert 0.8 < ceiling.accuracy <= 1  # chance is 0.1
    # The demo averages three students: each one's own accuracy is reported beside the average's.
    assert len(ceiling.member_accuracies) == config.student.members == 3
    assert all(0.8 < accuracy <= 1 for accuracy in ceiling.member_accuracies)
    assert "non-private" in ceiling.note and not hasattr(ceiling, "epsilon")
