"""A user's own model by import path: run from the user's working directory by the real
``conclave`` console script (no PYTHONPATH) in every pipeline, shipped to the workers by the
run itself, and a factory that breaks the contract stopped in one line before Ray starts."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from conclave.cluster.config import load_yaml
from conclave.cluster.ray_runtime import with_models
from tests.conftest import PROJECT_ROOT
from tests.user_model_sources import FACTORIES

CONCLAVE = Path(sys.executable).parent / "conclave"  # the console script users run

# The user's package. Its __init__ notes which file each process imported it from, so the test
# can see the workers import the copy Ray shipped, not the driver's folder.
INIT = '''
import os
with open({log!r}, "a") as log:
    log.write(f"{{os.getpid()}} {{__file__}}\\n")
'''
# Its models: the shared factories, one with logits but neither .features nor .classifier, and one
# with a logit too many.
MODELS = FACTORIES + '''
def bare(num_classes, in_channels, input_size):  # logits, but neither .features nor .classifier
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * input_size * input_size, num_classes))


def one_too_many(num_classes, in_channels, input_size):
    return Pictures(in_channels, input_size, num_classes + 1)
'''


def write_package(folder: Path) -> str:
    """The user's package ``clinic_<unique>`` in ``folder`` (unique: an in-process test must
    not find another test's module in ``sys.modules``); returns its name."""
    name = f"clinic_{folder.name.replace('-', '_').lower()}"
    (folder / name).mkdir()
    (folder / name / "__init__.py").write_text(INIT.format(log=str(folder / "imports.log")))
    (folder / name / "models.py").write_text(MODELS)
    (folder / name / "broken.py").write_text("import not_an_installed_dependency\n")
    return name


def teachers_digits(model: str) -> dict:
    """Two teachers on scikit-learn's digits, ``model`` for them and the student, few epochs and queries
    (owners' teachers train behind their gateways, which run registered models only)."""
    train = {"epochs": 2, "batch_size": 32, "lr": 0.003}
    return {"pipeline": "teacher_student", "name": "teachers", "data": {"name": "digits", "public_size": 100},
            "teachers": {"count": 2, "model": model, "train": train},
            "mechanism": {"name": "gnmax", "params": {"sigma": 2.0}}, "privacy": {"budget": 1000.0, "delta": 1e-5},
            "student": {"queries": 10, "batch_size": 10, "checkpoints": [], "model": model, "train": train,
                        "semi_supervised": None, "label_propagation": None}}


def hospitals_with(model: str) -> dict:
    """configs/hospitals.yaml with absolute paths and ``model`` for its teachers: owners' teachers train
    behind their gateways, which refuse it."""
    raw = load_yaml(PROJECT_ROOT / "configs" / "hospitals.yaml")
    for section in [owner["data"] for owner in raw["owners"]] + [raw["public"], raw["test"]]:
        section["path"] = str(PROJECT_ROOT / section["path"])
    raw["teachers"]["model"] = model
    return raw


def active_digits(model: str) -> dict:
    return {"pipeline": "active_learning", "name": "active", "model": model,
            "data": {"name": "digits", "private_size": 300, "num_shards": 1, "public_size": 200},
            "dpsgd": {"epochs": 1, "batch_size": 50, "noise_multiplier": 1.0},
            "selection": {"strategies": ["random", "entropy"], "sizes": [20]},
            "finetune": {"epochs": 1},
            "runtime_env": {"env_vars": {"CONCLAVE_USER_MODEL_TEST": "1"}}}  # the user's own, merged


def sparse_digits(model: str) -> dict:
    return {"pipeline": "sparse_finetune", "name": "sparse", "model": {"name": model, "kwargs": {}},
            "public": {"dataset": "digits", "classes": [0, 1, 2, 3, 4], "size": 200},
            "private": {"dataset": "digits", "classes": [5, 6, 7, 8, 9], "size": 200},
            "pretrain": {"epochs": 1},
            "finetune": {"variants": ["classifier"], "epochs": 1, "batch_size": 50, "target_epsilon": 1.0}}


def conclave(args: list[str], cwd: Path, ray_dir: str, timeout: float) -> subprocess.CompletedProcess:
    """The console script, as a user runs it: from ``cwd``, without PYTHONPATH, its Ray's files under ``ray_dir``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["RAY_TMPDIR"] = ray_dir
    return subprocess.run([str(CONCLAVE), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def ray_dir():
    """A short path of its own for a subprocess's Ray (socket paths have a length limit)."""
    path = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_users_package_joins_py_modules_beside_what_the_user_gave(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    package = write_package(tmp_path)
    model, folder = f"{package}.models:table", str((tmp_path / package).resolve())
    given = {"env_vars": {"A": "1"}, "py_modules": ["s3://bucket/other.zip"]}
    assert with_models(given, [model, "mlp", None]) == {"env_vars": {"A": "1"},
                                                         "py_modules": ["s3://bucket/other.zip", folder]}
    assert given["py_modules"] == ["s3://bucket/other.zip"]  # the config's own value is left as it was
    assert with_models({"py_modules": [f"./{package}"]}, [model]) == {"py_modules": [f"./{package}"]}  # named already
    assert with_models({}, ["logistic_regression", "numpy.linalg:norm"]) == {}  # built in, installed


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["teacher_student", "active_learning", "sparse_finetune"])
def test_a_users_model_by_import_path_runs_in_every_pipeline_from_the_working_directory(tmp_path, ray_dir, pipeline):
    """``model: clinic.models:image`` (with .features and .classifier): ``conclave run`` finds the
    package in its working directory and ships it to the workers; nothing else is set up."""
    package = write_package(tmp_path)
    raw = {"teacher_student": lambda: teachers_digits(f"{package}.models:image"),
           "active_learning": lambda: active_digits(f"{package}.models:image"),
           "sparse_finetune": lambda: sparse_digits(f"{package}.models:image")}[pipeline]()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    run = conclave(["run", "config.yaml", "--results-dir", "out"], tmp_path, ray_dir, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    folder = tmp_path / "out" / raw["name"]
    metrics = json.loads((folder / "metrics.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    if pipeline == "teacher_student":
        assert config["teachers"]["model"] == config["student"]["model"] == f"{package}.models:image"
        assert metrics["queries_answered"] > 0
    elif pipeline == "active_learning":
        assert config["model"] == f"{package}.models:image" and len(metrics["results"]) == 2
    else:
        assert config["model"]["name"] == f"{package}.models:image" and set(metrics["variants"]) == {"classifier"}
    # The run gave Ray the package, for workers on nodes without this folder (on this one machine
    # Ray also puts the driver's working directory on the workers' path, and that copy comes first).
    assert f"shipping {(tmp_path / package).resolve()} to Ray's workers (runtime_env py_modules)" in run.stderr


@pytest.mark.slow
def test_workers_import_the_shipped_copy_when_the_users_folder_is_the_drivers_alone(tmp_path, ray_dir):
    """The package is on the driver's path only (inserted in its process, the run started
    from elsewhere): the shard actor can build the model only from what the run gave Ray."""
    package = write_package(tmp_path)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(sparse_digits(f"{package}.models:image")))
    driver = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from conclave.cluster.cli import main; "
              f"sys.exit(main(['run', {str(tmp_path / 'config.yaml')!r}, '--results-dir', {str(tmp_path / 'out')!r}]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", driver], cwd=PROJECT_ROOT, env={**env, "RAY_TMPDIR": ray_dir},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    imported = (tmp_path / "imports.log").read_text().splitlines()
    assert any("runtime_resources/py_modules_files" in line for line in imported), imported


def _bad(tmp_path: Path, package: str, case: str) -> tuple[list[str], dict, str]:
    """(command, config, the one line expected after 'conclave: ') of a bad factory ``case``."""
    p = package
    cases = {
        "arguments": (["run"], teachers_digits(f"{p}.models:needs_hidden"),
                      f"teachers.model: model '{p}.models:needs_hidden' cannot be called as the contract calls it "
                      "(missing a required argument: 'hidden'): the contract passes num_classes and any of "
                      "in_channels, input_size, input_shape, standardiser the factory declares (here: num_classes=10, "
                      "input_shape=(1, 8, 8)); the factory declares num_classes, input_shape, hidden"),
        "output": (["run"], teachers_digits(f"{p}.models:one_too_many"),
                   f"teachers.model: model '{p}.models:one_too_many' maps a batch of shape [2, 1, 8, 8] to [2, 11]; "
                   "the contract wants logits [batch, num_classes] = [2, 10]"),
        "import": (["run"], teachers_digits(f"{p}.broken:build"),
                   f"teachers.model: model '{p}.broken:build' cannot be imported here: module '{p}.broken': "
                   "ModuleNotFoundError: No module named 'not_an_installed_dependency' (modules are found from the "
                   "working directory and the installed packages)"),
        "features": (["run"], active_digits(f"{p}.models:bare"),
                     f"model: model '{p}.models:bare' has no .features(x) (the activations before the logits), which "
                     "active learning embeds the public pool with (every strategy's PublicPool)"),
        "classifier": (["run"], sparse_digits(f"{p}.models:bare"),
                       f"model.name: model '{p}.models:bare' has no .classifier (the last nn.Linear), which sparse "
                       "fine-tuning replaces for the private task"),
        "serve": (["serve"], teachers_digits(f"{p}.models:one_too_many"),
                  f"teachers.model: model '{p}.models:one_too_many' maps a batch of shape [2, 1, 8, 8] to [2, 11]; "
                  "the contract wants logits [batch, num_classes] = [2, 10]"),
        "owners": (["run"], hospitals_with(f"{p}.models:table"),
                   f"teachers.model '{p}.models:table': owners' teachers train behind their gateways, which train a "
                   "registered model (a gateway runs no code a config names)"),
    }
    return cases[case]


@pytest.mark.parametrize("case", ["arguments", "output", "import", "features", "classifier", "serve", "owners"])
def test_a_bad_factory_is_one_line_and_exit_2_before_ray_starts(tmp_path, monkeypatch, capsys, case):
    import ray

    from conclave.cluster import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI adds the working directory, for this test only
    command, raw, line = _bad(tmp_path, write_package(tmp_path), case)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    was_running = ray.is_initialized()
    results = ["--results-dir", "out"] if command == ["run"] else ["--ledger", "out/ledger.sqlite"]
    assert cli.main([*command, "config.yaml", *results]) == 2
    assert capsys.readouterr().err == f"conclave: {line}\n"
    assert ray.is_initialized() == was_running and not (tmp_path / "out").exists()


def test_a_bad_factory_in_a_sweep_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from conclave.cluster import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    package = write_package(tmp_path)
    sweep = load_yaml(PROJECT_ROOT / "configs" / "tune-digits-teachers.yaml")
    sweep["base"]["teachers"]["model"] = f"{package}.models:needs_hidden"
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    assert cli.main(["tune", "sweep.yaml", "--results-dir", "out"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"conclave: base + space: teachers.model: model '{package}.models:needs_hidden' cannot be "
                          "called as the contract calls it (missing a required argument: 'hidden')")
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_the_console_script_stops_a_bad_factory_before_any_ray_process(tmp_path, ray_dir):
    """The real command from the user's folder: one line, exit 2, and Ray never started (its
    temporary folder stays empty)."""
    package = write_package(tmp_path)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(teachers_digits(f"{package}.models:one_too_many")))
    started = time.perf_counter()
    run = conclave(["run", "config.yaml", "--results-dir", "out"], tmp_path, ray_dir, timeout=300)
    elapsed = time.perf_counter() - started
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr == (f"conclave: teachers.model: model '{package}.models:one_too_many' maps a batch of shape "
                          "[2, 1, 8, 8] to [2, 11]; the contract wants logits [batch, num_classes] = [2, 10]\n")
    assert os.listdir(ray_dir) == [] and not (tmp_path / "out").exists()
    assert elapsed < 120  # imports only (a few seconds on an idle machine): no Ray start, no training
