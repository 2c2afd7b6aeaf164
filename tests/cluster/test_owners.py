"""Owners' own data: the three-hospital CSV example on the embedded Ray and on a three-node
local cluster, placement by node, the driver never opening an owner's file, one-line errors."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
import yaml

from conclave.cluster.config import ConfigError, load_yaml
from conclave.cluster.pipelines import load_pipeline
from conclave.learning.embeddings import NetworkEmbedding
from tests.conftest import PROJECT_ROOT

HOSPITALS = PROJECT_ROOT / "configs" / "hospitals.yaml"
HOSPITALS_ACTIVE = PROJECT_ROOT / "configs" / "hospitals-active.yaml"
DATA = PROJECT_ROOT / "examples" / "hospitals" / "data"


def hospitals(**changes):
    config = load_pipeline(load_yaml(HOSPITALS)).config
    return dataclasses.replace(config, **changes)


def test_the_example_data_is_what_make_data_writes(tmp_path):
    """The committed CSVs are reproducible from scikit-learn's bundled data by one command."""
    subprocess.run([sys.executable, str(PROJECT_ROOT / "examples" / "hospitals" / "make_data.py"),
                    "--out", str(tmp_path)], check=True, capture_output=True)
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.csv"))
    assert written == sorted(p.relative_to(DATA) for p in DATA.rglob("*.csv")) and len(written) == 6
    assert all((tmp_path / p).read_bytes() == (DATA / p).read_bytes() for p in written)


@pytest.fixture(scope="module")
def three_node_runs(tmp_path_factory) -> dict[str, dict]:
    """Both owners pipelines on one three-node cluster (one start for the two): what
    examples/hospitals/three_nodes.py printed of each, by config name."""
    run = subprocess.run([sys.executable, str(PROJECT_ROOT / "examples" / "hospitals" / "three_nodes.py"),
                          str(HOSPITALS), str(tmp_path_factory.mktemp("three-nodes")), "--also", str(HOSPITALS_ACTIVE)],
                         cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.strip().splitlines()[-2:]]
    return {result["config"]: result for result in results}


@pytest.mark.slow
@pytest.mark.parametrize("config, actors", [(HOSPITALS, "teachers"), (HOSPITALS_ACTIVE, "DP-SGD")])
def test_each_owners_actors_run_on_its_own_node_of_a_three_node_cluster(three_node_runs, config, actors):
    """Head + three owner nodes (``ray.cluster_utils.Cluster`` on loopback), in a process of
    its own, with Ray's TLS on; owners pinned by custom resource and node label. Teachers, or
    DP-SGD shard actors that train as one data-parallel group across the three nodes."""
    result = three_node_runs[load_yaml(config)["name"]]
    assert result["actor_nodes"] == {name: [node] for name, node in result["owner_nodes"].items()}
    assert len(set(result["owner_nodes"].values())) == 3
    # each owner's lifetime ledger lives in an actor on its own node; `conclave budget` lists the three
    assert {name: ledger["node"] for name, ledger in result["owner_ledgers"].items()} == result["owner_nodes"]
    assert sorted(entry["name"] for entry in result["budget_listing"]) == sorted(result["owner_nodes"])
    assert all(entry["charges"] > 0 and entry["budget"] == 20.0 for entry in result["budget_listing"])
    assert result["driver_opened_owner_files"] == []
    assert any(p.endswith("test.csv") for p in result["driver_opened_public_files"])  # the hook saw opens
    if actors == "teachers":
        assert result["summary"]["queries_answered"] > 0
    else:
        assert result["summary"]["dp_checkpoint_accuracy"] > 0.75  # majority class: 0.63; runs: 0.94–0.97
    # An owner whose resource no node declares: one line naming it, within seconds.
    assert f"owner hospital_d's {actors}: no node of the cluster has" in result["placement_error"]
    assert "hospital_d=1" in result["placement_error"] and "\n" not in result["placement_error"]
    assert result["placement_error_seconds"] < 30
    # Ray's links are TLS, probed on every port the cluster's processes listen on (all loopback):
    # no gRPC server answers in plaintext or a peer without a certificate from the cluster's CA,
    # and the GCS and every node's raylet answer one with it.
    assert result["ray_tls"]
    listeners = result["listeners"].values()
    assert {listener["address"] for listener in listeners} <= {"127.0.0.1", "::ffff:127.0.0.1"}
    assert not any(listener["plaintext_grpc"] or listener["tls_without_certificate"] for listener in listeners)
    members = {int(port) for port, listener in result["listeners"].items() if listener["tls_with_node_certificate"]}
    assert len(result["raylet_ports"]) == 4 and {result["gcs_port"], *result["raylet_ports"]} <= members


def test_a_missing_owner_file_is_one_line_naming_the_owner(ray_session, tmp_path):
    from conclave.actors.owners import OwnerDataError
    from conclave.cluster.teaching.ensemble import public_data, teacher_pool

    owners = list(hospitals().owners)
    owners[1] = dataclasses.replace(owners[1], data=dataclasses.replace(owners[1].data, path=str(tmp_path / "gone.csv")))
    config = hospitals(owners=tuple(owners), public=hospitals().public.anchored(str(PROJECT_ROOT)),
                       test=hospitals().test.anchored(str(PROJECT_ROOT)))
    started = time.perf_counter()
    with pytest.raises(OwnerDataError) as err:
        teacher_pool(config, public_data(config))
    assert str(err.value) == f"owner hospital_b: {tmp_path / 'gone.csv'}: no such file or folder"
    assert time.perf_counter() - started < 60
    assert _released(ray_session, "hospital_a")  # the actors that did start were stopped


def _released(ray, resource: str, timeout: float = 20.0) -> bool:
    """Whether the node's whole ``resource`` is free again (Ray frees a killed actor's share
    asynchronously)."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get(resource) != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get(resource) == 1


def _flawed_owner_files(tmp_path):
    """The three hospitals' files with flawed records: hospital_a holds one record fewer than it
    declares; hospital_b has a label outside the classes, and an extra field on its first line
    (pandas once took the first column of every line for an index then); hospital_c a missing
    value, and a value finite in float64 but past float32's range (it once aborted the run)."""
    import pandas as pd

    flawed = {}
    for name in ("hospital_a", "hospital_b", "hospital_c"):
        table = pd.read_csv(DATA / name / "records.csv")
        if name == "hospital_a":
            table = table.iloc[1:]
        elif name == "hospital_b":
            table["diagnosis"] = table["diagnosis"].astype(object)
            table.loc[3, "diagnosis"] = "unsure"
        else:
            table.loc[7, "mean_radius"] = None
            table.loc[20, "worst_area"] = 1e39
        flawed[name] = tmp_path / f"{name}.csv"
        table.to_csv(flawed[name], index=False)
    lines = flawed["hospital_b"].read_text().splitlines()
    lines[1] += ",1.0"
    flawed["hospital_b"].write_text("\n".join(lines) + "\n")
    return flawed


def _flawed_config(tmp_path, config=HOSPITALS):
    """``config`` (configs/hospitals.yaml) with the flawed owner files above."""
    flawed = _flawed_owner_files(tmp_path)
    raw = load_yaml(config)
    for owner in raw["owners"]:
        owner["data"]["path"] = str(flawed[owner["name"]])
    config_file = tmp_path / "flawed.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    return config_file


def _as_printed(text: str) -> str:
    """What a run printed, with every number masked (answers and accuracies come from
    mechanisms), each progress display once, at its last state, without its timing (seconds and
    rates are not published; how often a display is redrawn is a matter of time)."""
    import itertools
    import re

    lines = [line.rsplit("\r", 1)[-1] for line in text.split("\n")]
    # a number is one mark whatever its form ("8" or "7.7": what earlier runs spent shows through)
    lines = [re.sub(r"\d+(?:\.\d+)?", "#", re.sub(r"\s*\[[^\]]*\]$", "", line) if "%|" in line else line)
             for line in lines]
    return "\n".join(line for line, _ in itertools.groupby(lines))


@pytest.mark.slow
def test_the_three_owner_csv_example_runs_and_a_flawed_record_changes_nothing_it_publishes_but_its_answers(
        ray_session, tmp_path, monkeypatch, capsys, driver_opens):
    """The example's files, then flawed ones, on the embedded Ray (one run of the example for both
    checks). The clean run: the driver reads no owner's file, the teachers are placed on the three
    owners' resources, the table student is saved. The flawed files: one record fewer than
    declared, an unknown label, a missing value, a value past float32, a line with an extra field:
    the run finishes, with the guarantee the config alone fixes, it prints what the run on the
    example's files prints (numbers aside) and writes the same files, and nothing it prints or
    writes names a flaw."""
    from conclave.cluster import cli

    monkeypatch.chdir(PROJECT_ROOT)
    printed, written = {}, {}
    # the flawed files are written (from the example's, by this process) once the clean run is checked
    for name, config_file in (("clean", lambda: HOSPITALS), ("flawed", lambda: _flawed_config(tmp_path))):
        results = tmp_path / name
        assert cli.main(["run", str(config_file()), "--results-dir", str(results)]) == 0
        out, err = capsys.readouterr()
        printed[name] = (_as_printed(out.replace(str(results), "RESULTS")), _as_printed(err))
        written[name] = sorted(p.relative_to(results).as_posix() for p in results.rglob("*"))
        if name == "clean":
            _check_the_clean_run(tmp_path / name, driver_opens())
    assert printed["flawed"] == printed["clean"] and written["flawed"] == written["clean"]
    privacy = json.loads((tmp_path / "flawed" / "hospitals" / "privacy.json").read_text())
    config = load_pipeline(load_yaml(HOSPITALS)).config
    assert privacy["guarantee"] == config.privacy.guarantee(config.planned()).as_dict() and privacy["sound"]
    assert privacy["aggregation"] == "trusted-aggregator"  # the aggregator sees clean votes, and says so
    published = "".join(printed["flawed"]) + "".join(
        f.read_text() for f in (tmp_path / "flawed" / "hospitals").glob("*.json"))
    assert not any(word in published for word in ("unsure", "missing", "fewer", "dropped", "usable", "float32",
                                                   "fields"))


def _check_the_clean_run(results, opened: set[str]) -> None:
    """The three-owner CSV example's run on the embedded Ray, without the driver reading owner files."""
    owner_files = {str((DATA / name / "records.csv").resolve()) for name in ("hospital_a", "hospital_b", "hospital_c")}
    assert not owner_files & opened
    assert str((DATA / "public" / "unlabeled.csv").resolve()) in opened
    metrics = json.loads((results / "hospitals" / "metrics.json").read_text())
    assert metrics["teachers"]["count"] == 30 and set(metrics["teachers"]["nodes"]) == {
        "hospital_a", "hospital_b", "hospital_c"}
    assert metrics["label_accuracy"] is None  # the pool has no labels
    # majority class: 0.63; runs score 0.91–0.95, and once 0.76 (40 GNMax answers at σ = 10 are noisy)
    assert metrics["queries_answered"] > 0 and metrics["student_accuracy"] > 0.7
    config = json.loads((results / "hospitals" / "config.json").read_text())
    assert config["teachers"]["model"] == config["student"]["model"] == "logistic_regression"
    # the table student is saved as any student is, its public standardiser with it
    student = NetworkEmbedding.load(results / "hospitals" / "student.pt")
    public = pd.read_csv(DATA / "public" / "unlabeled.csv").to_numpy(dtype=np.float32)
    assert student.model == "logistic_regression" and student(public[:5]).shape[0] == 5
    assert not np.allclose(student.state["features.mean"], 0)  # the pool's column means, not a fresh model's


def test_check_data_shows_an_owner_its_own_flaws_and_a_run_would_do(tmp_path, monkeypatch, capsys):
    from conclave.cluster import cli

    config_file = _flawed_config(tmp_path)
    monkeypatch.chdir(PROJECT_ROOT)
    assert cli.main(["check-data", str(config_file), "--owner", "hospital_b"]) == 1
    out = capsys.readouterr().out
    assert "rows read: 100; usable: 98; dropped: 2" in out
    assert "label 'unsure' not among the classes ['benign', 'malignant'] (row 3)" in out
    assert "32 fields where the header has 31 (row 0)" in out
    # a missing or unusable cell is filled with the public pool's column mean: the row is kept, and said so
    assert cli.main(["check-data", str(config_file), "--owner", "hospital_c"]) == 0
    out = capsys.readouterr().out
    assert "dropped: 0" in out and "rows kept with cells filled by the public pool's column means: 2" in out
    assert "row 7: missing value in column 'mean_radius'" in out
    assert "row 20: out-of-range (past float32's) value in column 'worst_area'" in out
    assert cli.main(["check-data", str(config_file), "--owner", "hospital_a"]) == 0
    out = capsys.readouterr().out
    assert "usable here: 99" in out and "fewer than declared: a run uses what there is" in out
    assert cli.main(["check-data", str(config_file), "--owner", "hospital_z"]) == 2
    assert "no owner 'hospital_z' in the config" in capsys.readouterr().err


def test_check_data_warns_an_owner_whose_usable_rows_hold_one_class(tmp_path, monkeypatch, capsys):
    """The owner's own business, told only to it: a run trains on one class all the same (its
    actors' data keep the run's class list, so nothing of it shows), but the owner should know."""
    import pandas as pd

    from conclave.actors.owners import OwnerSource
    from conclave.cluster import cli

    table = pd.read_csv(DATA / "hospital_b" / "records.csv")
    table[table["diagnosis"] == "benign"].to_csv(tmp_path / "benign.csv", index=False)
    table.iloc[:1].assign(diagnosis="unsure").to_csv(tmp_path / "unsure.csv", index=False)
    monkeypatch.chdir(PROJECT_ROOT)
    for name, status, warning in (("benign", 0, "warning: every usable row is of class 'benign': what your data "
                                                "teaches a run is that class alone (none of 'malignant')"),
                                  ("unsure", 1, "warning: no usable rows: a run goes on, and your data teaches "
                                                "it nothing")):
        raw = load_yaml(HOSPITALS)
        raw["owners"][1]["data"]["path"] = str(tmp_path / f"{name}.csv")
        config_file = tmp_path / f"{name}.yaml"
        config_file.write_text(yaml.safe_dump(raw))
        assert cli.main(["check-data", str(config_file), "--owner", "hospital_b"]) == status
        assert warning in capsys.readouterr().out
        owner = load_pipeline(raw).config.owners[1]
        shards = OwnerSource(owner.name, owner.data, 10, ("benign", "malignant")).load(range(10))
        assert {(part.num_classes, part.input_shape) for part in shards} == {(2, (30,))}
    assert cli.main(["check-data", str(HOSPITALS), "--owner", "hospital_b"]) == 0
    assert "warning" not in capsys.readouterr().out


def _knn_actor_says(owner, config, public):
    """What a kNN shard actor of ``owner`` says (run in this process: the actor's class), after
    checking that its distances to a few public queries are finite."""
    import numpy as np

    from conclave.actors.knn_votes import KnnShard
    from conclave.actors.owners import OwnerSource
    from conclave.cluster.owners import owner_data
    from conclave.learning.embeddings import fit_embedding

    embed = fit_embedding(config.knn.embedding, public.splits.public.x, config.knn.dims)
    source = OwnerSource(owner.name, owner_data(owner, public.reading, str(PROJECT_ROOT)), 2, public.classes,
                         config.seed)
    shard = KnnShard(source, 0, 2, embed, config.knn.k, config.knn.sample_rate, index=0)
    distances, labels = shard.neighbours(embed(public.splits.test.x[:5]), 1)
    assert np.isfinite(distances[labels >= 0]).all()
    return shard.describe()


def _dpsgd_actor_says(owner, config, public):
    """What a DP-SGD shard actor of ``owner`` says (its class, in this process), after checking
    that one epoch of DP-SGD on its records leaves finite weights."""
    import numpy as np

    from conclave.actors.dp_trainer import ModelSpec, OwnerShards, ShardHolder
    from conclave.actors.owners import OwnerSource
    from conclave.cluster.owners import owner_data
    from conclave.learning.dp_schedule import DPSGDConfig
    from conclave.privacy.noise import SECURE

    source = OwnerSource(owner.name, owner_data(owner, public.reading, str(PROJECT_ROOT)), 1, public.classes,
                         config.seed)
    spec = ModelSpec(config.model, len(public.classes), input_shape=public.schema.shape,
                     standardiser=public.standardiser)
    holder = ShardHolder(OwnerShards(source), [0], spec)
    epoch = DPSGDConfig(epochs=1, batch_size=config.dpsgd.batch_size, lr=config.dpsgd.lr,
                        max_grad_norm=config.dpsgd.max_grad_norm, noise_multiplier=config.dpsgd.noise_multiplier)
    weights = holder.train_dp(epoch, SECURE, num_examples=owner.records)[-1].state
    assert all(np.isfinite(w).all() for w in weights.values())
    return holder.describe()


@pytest.mark.parametrize("config, says", [(PROJECT_ROOT / "configs" / "hospitals-knn.yaml", _knn_actor_says),
                                          (HOSPITALS_ACTIVE, _dpsgd_actor_says)], ids=["knn", "dpsgd"])
def test_a_flawed_record_changes_nothing_an_owners_knn_or_dpsgd_actor_says(tmp_path, config, says):
    """The kNN and DP-SGD pipelines read an owner's file in its actors as the teachers do
    (``OwnerSource``). With the flawed files, and for an owner whose only record is flawed,
    each owner's actor loads and says what it says with the example's (classes, input shape),
    and what it computes from them stays finite."""
    import dataclasses

    import pandas as pd

    from conclave.cluster.owners import PublicData

    clean = load_pipeline(load_yaml(config)).config
    flawed = load_pipeline(load_yaml(_flawed_config(tmp_path, config))).config
    public = PublicData.read(clean.public.anchored(str(PROJECT_ROOT)), clean.test.anchored(str(PROJECT_ROOT)),
                             clean.classes)
    pd.read_csv(DATA / "hospital_b" / "records.csv").iloc[:1].assign(mean_area=1e39).to_csv(
        tmp_path / "one.csv", index=False)
    nothing_usable = dataclasses.replace(clean.owners[1], data=dataclasses.replace(
        clean.owners[1].data, path=str(tmp_path / "one.csv")))
    for clean_owner, flawed_owner in [*zip(clean.owners, flawed.owners), (clean.owners[1], nothing_usable)]:
        said = [says(owner, clean, public) for owner in (clean_owner, flawed_owner)]
        assert [(info.num_classes, info.input_shape) for info in said] == [(2, (30,))] * 2, flawed_owner.data.path


def test_teachers_keep_at_most_their_share_of_the_declared_records(ray_session):
    """An owner holding five times what it declares: each teacher's shard is cut to the cap on
    the owner's node; one holding fewer than it declares simply runs with them."""
    from conclave.actors.owners import OwnerSource
    from conclave.learning.data.dataset import shard_cap

    owner = hospitals().owners[0]
    source = OwnerSource(owner.name, owner.data.anchored(str(PROJECT_ROOT)), 10, ("benign", "malignant"),
                         records=20)
    shards = source.load(range(10))
    assert shard_cap(20, 10) == 7 and max(map(len, shards)) <= 7 and sum(map(len, shards)) < 100
    plenty = OwnerSource(owner.name, owner.data.anchored(str(PROJECT_ROOT)), 10, ("benign", "malignant"),
                         records=500)
    assert sum(map(len, plenty.load(range(10)))) == 100


def test_owners_whose_data_disagree_on_the_input_shape_are_refused(ray_session, tmp_path):
    import pandas as pd

    from conclave.actors.owners import OwnerDataError
    from conclave.cluster.teaching.ensemble import public_data, teacher_pool

    import numpy as np

    from conclave.learning.data.sources import DataSource

    # An array has no column names, so its width is all there is to check (a table lacking one
    # of the pool's columns is an error naming it: tests/cluster/test_table_columns.py).
    table = pd.read_csv(DATA / "hospital_c" / "records.csv").drop(columns="worst_area")
    np.savez(tmp_path / "c.npz", x=table.drop(columns="diagnosis").to_numpy(), y=table["diagnosis"].to_numpy(str))
    owners = list(hospitals().owners)
    owners[2] = dataclasses.replace(owners[2], data=DataSource("npz", str(tmp_path / "c.npz"), label="y"))
    config = hospitals(owners=tuple(owners), public=hospitals().public.anchored(str(PROJECT_ROOT)),
                       test=hospitals().test.anchored(str(PROJECT_ROOT)))
    with pytest.raises(OwnerDataError, match=r"owner hospital_c: 2 classes, inputs \[29\]"):
        teacher_pool(config, public_data(config))


@pytest.mark.parametrize("change, named", [
    ({"public": None}, "owners need a public pool and a test set"),
    ({"classes": ("a", "a")}, "classes must be distinct"),
])
def test_an_owners_config_that_cannot_run_is_a_config_error(change, named):
    with pytest.raises(ValueError, match=named):
        hospitals(**change)


def test_owner_names_and_placements_are_checked_when_the_config_loads():
    raw = load_yaml(HOSPITALS)
    raw["owners"][1]["name"] = raw["owners"][0]["name"]
    with pytest.raises(ConfigError, match="owner names must be distinct"):
        load_pipeline(raw)
    raw = load_yaml(HOSPITALS)
    raw["owners"][0]["resources"] = {"CPU": 1}
    with pytest.raises(ConfigError, match="custom resources"):
        load_pipeline(raw)
    raw = load_yaml(HOSPITALS)
    raw["owners"][0]["records"] = 4
    with pytest.raises(ConfigError, match="owner hospital_a: 10 teachers need at least as many records"):
        load_pipeline(raw)
    raw = load_yaml(HOSPITALS)
    raw["owners"][0]["data"]["format"] = "xlsx"
    with pytest.raises(ConfigError, match="unknown data format 'xlsx'"):
        load_pipeline(raw)


def test_a_public_file_the_driver_cannot_read_fails_before_ray_starts(tmp_path, capsys, monkeypatch):
    import ray

    from conclave.cluster import cli

    raw = load_yaml(HOSPITALS)
    raw["test"]["path"] = str(tmp_path / "missing.csv")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(PROJECT_ROOT)
    was_running = ray.is_initialized()
    assert cli.main(["run", str(path), "--results-dir", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"conclave: public/test: {tmp_path / 'missing.csv'}: no such file or folder"
    assert ray.is_initialized() == was_running
    assert not (tmp_path / "results").exists()  # config.json only after validation


def test_table_student_defaults_to_self_training_and_refuses_fixmatch(ray_session):
    from conclave.cluster.teaching.config import DEFAULT_STUDENT
    from conclave.cluster.teaching.ensemble import public_data, resolved
    from conclave.learning.semi_supervised import FixMatchConfig

    config = hospitals(public=hospitals().public.anchored(str(PROJECT_ROOT)),
                       test=hospitals().test.anchored(str(PROJECT_ROOT)))
    public = public_data(config)
    assert public.schema.kind == "table" and public.schema.shape == (30,) and public.classes == ("benign", "malignant")
    defaulted = resolved(dataclasses.replace(config, student=DEFAULT_STUDENT,
                                             teachers=dataclasses.replace(config.teachers, model=None)), public)
    assert defaulted.teachers.model == "mlp" and defaulted.student.semi_supervised is None
    fixmatch = dataclasses.replace(config.student, semi_supervised=FixMatchConfig(), pseudo_label_threshold=None)
    with pytest.raises(ValueError, match="FixMatch"):
        resolved(dataclasses.replace(config, student=fixmatch), public)


@pytest.mark.slow
def test_the_library_example_runs_the_three_owners_without_the_cli():
    run = subprocess.run([sys.executable, str(PROJECT_ROOT / "examples" / "hospitals" / "library.py")],
                         cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("teachers: 30 on nodes {'hospital_a': [")
    assert lines[1].startswith("student: ") and lines[2].startswith("guarantee ε = ")


@pytest.mark.slow
def test_a_users_own_model_by_import_path_reaches_the_workers_through_the_runtime_env(tmp_path):
    """The factory's package is on the driver's path only (inserted in-process, not through
    the environment the workers inherit): the teachers and the student can build it only
    because ``runtime_env.py_modules`` ships it to them."""
    package = tmp_path / "clinicmodels"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from torch import nn\n"
        "from conclave.learning.models.table import Standardise, TableModel\n\n"
        "def build(num_classes, in_channels=1, *, input_shape, standardiser=None):\n"
        "    return TableModel(Standardise(input_shape[0], standardiser), nn.Linear(input_shape[0], num_classes))\n")
    raw = load_yaml(HOSPITALS)
    for section in [owner["data"] for owner in raw["owners"]] + [raw["public"], raw["test"]]:
        section["path"] = str(PROJECT_ROOT / section["path"])
    raw["teachers"]["model"] = raw["student"]["model"] = "clinicmodels:build"
    raw["runtime_env"] = {"py_modules": [str(package)]}
    raw["student"].update(queries=10, checkpoints=[])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    driver = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from conclave.cluster.cli import main; "
              f"sys.exit(main(['run', {str(tmp_path / 'config.yaml')!r}, '--results-dir', {str(tmp_path / 'out')!r}]))")
    run = subprocess.run([sys.executable, "-c", driver], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "hospitals" / "metrics.json").read_text())
    assert metrics["teachers"]["model"] == "clinicmodels:build" and metrics["queries_answered"] > 0


def test_what_one_node_has_free_is_known_so_the_student_can_fit_small_nodes(ray_session):
    from conclave.actors.placement import largest_free

    free = largest_free()
    assert free is not None and 0 <= free <= 2  # the session's one node has 2 CPUs
    assert largest_free("GPU") == 0.0  # and no GPU: the student asks for none


def test_ray_certs_writes_a_ca_and_node_certificates_it_signs_for_the_nodes_addresses(tmp_path, capsys):
    """``conclave ray-certs``: a CA once, then a certificate per node naming its addresses (and
    loopback), keys readable by their owner only; each node's certificate, presented by a
    server and by a client, passes the other side's check for mutual TLS."""
    import socket
    import ssl
    import threading

    from cryptography import x509

    from conclave.cluster import cli

    assert cli.main(["ray-certs", str(tmp_path / "head"), "--hosts", "10.0.0.1", "head.example"]) == 0
    assert cli.main(["ray-certs", str(tmp_path / "a"), "--ca", str(tmp_path / "head"), "--hosts", "10.0.0.7"]) == 0
    out = capsys.readouterr().out
    assert f"export RAY_USE_TLS=1 RAY_TLS_SERVER_CERT={tmp_path / 'a' / 'node.pem'} " in out
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["ca.pem", "node.key", "node.pem"]
    for key in (tmp_path / "head" / "ca.key", tmp_path / "head" / "node.key", tmp_path / "a" / "node.key"):
        assert key.stat().st_mode & 0o777 == 0o600
    certificate = x509.load_pem_x509_certificate((tmp_path / "a" / "node.pem").read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.7", "127.0.0.1"]
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]

    def context(side, node):
        made = ssl.SSLContext(side)
        made.load_verify_locations(tmp_path / node / "ca.pem")
        made.load_cert_chain(tmp_path / node / "node.pem", tmp_path / node / "node.key")
        made.verify_mode = ssl.CERT_REQUIRED
        return made

    server = context(ssl.PROTOCOL_TLS_SERVER, "a")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def accept():
            connection, _ = listener.accept()
            with server.wrap_socket(connection, server_side=True) as tls:
                tls.sendall(tls.getpeercert()["subject"][0][0][1].encode())

        thread = threading.Thread(target=accept)
        thread.start()
        with context(ssl.PROTOCOL_TLS_CLIENT, "head").wrap_socket(
                socket.create_connection(listener.getsockname()), server_hostname="127.0.0.1") as client:
            assert client.recv(100) == b"10.0.0.1"  # the server saw the head's certificate
        thread.join(timeout=10)

    # one line each: a second CA over the first, a CA that is not there, a list passed as one host
    assert cli.main(["ray-certs", str(tmp_path / "head")]) == 2
    assert "ca.key exists: a new CA would orphan the nodes it signed" in capsys.readouterr().err
    assert cli.main(["ray-certs", str(tmp_path / "b"), "--ca", str(tmp_path / "none"), "--hosts", "10.0.0.8"]) == 2
    assert capsys.readouterr().err.strip() == f"conclave: {tmp_path / 'none' / 'ca.pem'}: no such file " \
                                               "(create the CA first: conclave ray-certs DIR)"
    assert cli.main(["ray-certs", str(tmp_path / "c"), "--hosts", "10.0.0.8,10.0.0.9"]) == 2
    assert capsys.readouterr().err.strip() == "conclave: not an IP address or a host name: '10.0.0.8,10.0.0.9'"
    assert not (tmp_path / "c").exists()  # nothing written
    assert cli.main(["ray-certs", str(tmp_path / "d"), "--hosts", "head_node!"]) == 2  # not an RFC 1123 name
    assert capsys.readouterr().err.strip() == "conclave: not an IP address or a host name: 'head_node!'"
