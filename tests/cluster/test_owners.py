"""Owners' own data: the three-hospital CSV example, each hospital behind a gateway the run starts on
this machine, the driver never opening an owner's file, flawed records changing nothing published,
one-line errors."""
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
from conclave.learning.train_config import TrainConfig
from conclave.privacy.accounting.rdp import epsilon_from_rdp
from conclave.privacy.mechanisms import SecureGNMax
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


def test_a_missing_owner_file_is_one_line_naming_the_owner(ray_session, tmp_path):
    """Its gateway (started here: the owners are named by their data) refuses the run in one line naming
    the owner and its file as declared; the other owners' gateways, and the actors they started, stop."""
    from conclave.cluster.teaching.ensemble import train_ensemble
    from conclave.privacy.accounting.owner_policy import OwnerBudget, OwnerRefused

    owners = [dataclasses.replace(owner, teachers=2, budget=OwnerBudget(20.0, directory=str(tmp_path / owner.name)))
              for owner in hospitals().owners]
    owners[1] = dataclasses.replace(owners[1], data=dataclasses.replace(owners[1].data, path=str(tmp_path / "gone.csv")))
    config = hospitals(owners=tuple(owners), public=hospitals().public.anchored(str(PROJECT_ROOT)),
                       test=hospitals().test.anchored(str(PROJECT_ROOT)),
                       teachers=dataclasses.replace(hospitals().teachers, train=TrainConfig(epochs=1)))
    cpus = ray_session.available_resources().get("CPU")
    started = time.perf_counter()
    with pytest.raises(OwnerRefused) as err:
        train_ensemble(config, progress=False)
    assert str(err.value) == f"owner hospital_b: {tmp_path / 'gone.csv'}: no such file or folder"
    assert time.perf_counter() - started < 120
    assert _released(ray_session, cpus)  # the actors that did start were stopped


def _released(ray, cpus: float, timeout: float = 20.0) -> bool:
    """Whether the node's CPUs free before are free again (Ray frees a killed actor's share asynchronously)."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU") != cpus and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get("CPU") == cpus


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
    lines = [re.sub(r"-[0-9a-f#]{8}\b", "-RUN", line) for line in lines]  # the run's id at the gateways: fresh
    lines = [re.sub(r"# charge\b", "# charges", line) for line in lines]  # a noun's number follows the count
    return "\n".join(line for line, _ in itertools.groupby(lines))


@pytest.mark.slow
def test_the_three_owner_csv_example_runs_and_a_flawed_record_changes_nothing_it_publishes_but_its_answers(
        ray_session, tmp_path, monkeypatch, capsys, driver_opens):
    """The example's files, then flawed ones, on the embedded Ray (one run of the example for both
    checks). The clean run: the driver reads no owner's file, the teachers train behind the three
    owners' gateways, the table student is saved. The flawed files: one record fewer than
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
    assert privacy["aggregation"] == "secure"  # the votes meet only in the secure sum, and it says so
    assert set(privacy["owners"]) == {"hospital_a", "hospital_b", "hospital_c"}  # each one's lifetime account
    published = "".join(printed["flawed"]) + "".join(
        f.read_text() for f in (tmp_path / "flawed" / "hospitals").glob("*.json"))
    assert not any(word in published for word in ("unsure", "missing", "fewer", "dropped", "usable", "float32",
                                                   "fields"))


def _check_the_clean_run(results, opened: set[str]) -> None:
    """The three-owner CSV example's run through the gateways it started, without the driver reading owner files."""
    owner_files = {str((DATA / name / "records.csv").resolve()) for name in ("hospital_a", "hospital_b", "hospital_c")}
    assert not owner_files & opened
    assert str((DATA / "public" / "unlabeled.csv").resolve()) in opened
    metrics = json.loads((results / "hospitals" / "metrics.json").read_text())
    assert metrics["teachers"]["count"] == 30 and set(metrics["teachers"]["nodes"]) == {
        "hospital_a", "hospital_b", "hospital_c"}
    assert metrics["label_accuracy"] is None  # the pool has no labels
    # majority class: 0.63; runs scored 0.86–0.94 (10 GNMax answers at σ = 5, one secure round)
    assert metrics["queries_answered"] == 10 and metrics["student_accuracy"] > 0.7  # GNMax answers every query
    # the votes met only in the secure sum: its Skellam charge, the worst case of every planned query answered
    privacy = json.loads((results / "hospitals" / "privacy.json").read_text())
    assert privacy["trust_model"]["trusted"] == [] and "masked share" in privacy["trust_model"]["statement"]
    assert privacy["mechanism"]["name"] == "secure-gnmax" and set(privacy["spent"]["by_label"]) == {"secure-gnmax"}
    assert privacy["estimates"] == [] and "clean votes" in privacy["estimates_note"]
    planned = SecureGNMax(5.0).run_charge(10, 10)
    worst = epsilon_from_rdp(planned.orders, planned.rdp, 1e-5)[0]
    assert privacy["guarantee"]["basis"] == "worst-case" and privacy["guarantee"]["epsilon"] == pytest.approx(worst)
    assert privacy["spent"]["epsilon"] == pytest.approx(worst)
    for owner, account in privacy["owners"].items():  # each owner's ledger, charged each round by its gateway
        assert account["spent"]["charges"] - account["spent"]["charges_before_run"] == 1, owner
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


def _dpsgd_gateway_reads(owner, config, public):
    """What ``owner``'s gateway reads for DP-SGD steps (its records, as a run reads them: the dataset's
    classes and input shape), after checking that a step's clipped gradient sum over every record
    (q = 1) stays finite."""
    import numpy as np

    from conclave.actors.dp_trainer import ModelSpec
    from conclave.cluster.owners import owner_data
    from conclave.learning.owner_step import OwnerSteps

    dataset, _ = owner_data(owner, public.reading, str(PROJECT_ROOT)).read_private(public.classes, name=owner.name)
    model = ModelSpec(config.model, len(public.classes), input_shape=public.schema.shape,
                      standardiser=public.standardiser).build()
    steps = OwnerSteps(model, dataset.x, dataset.y, 1.0, 1, owner.records, config.dpsgd.max_grad_norm)
    assert np.isfinite(steps.clipped_sum([p.detach().numpy() for p in model.parameters()])).all()
    return dataset


@pytest.mark.parametrize("config, says", [(PROJECT_ROOT / "configs" / "hospitals-knn.yaml", _knn_actor_says),
                                          (HOSPITALS_ACTIVE, _dpsgd_gateway_reads)], ids=["knn", "dpsgd"])
def test_a_flawed_record_changes_nothing_an_owners_knn_actor_or_dpsgd_steps_say(tmp_path, config, says):
    """kNN votes read an owner's file in its actors as the teachers do (``OwnerSource``), DP-SGD
    steps in its gateway. With the flawed files, and for an owner whose only record is flawed,
    each reads what it reads with the example's (classes, input shape), and what it computes
    from them stays finite."""
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


def test_an_owner_whose_data_disagree_with_the_runs_inputs_is_refused(ray_session, tmp_path):
    """Its gateway refuses the run before its teachers train, in one line naming the owner."""
    import numpy as np

    from conclave.cluster.teaching.ensemble import train_ensemble
    from conclave.learning.data.sources import DataSource
    from conclave.privacy.accounting.owner_policy import OwnerBudget, OwnerRefused

    # An array has no column names, so its width is all there is to check (a table lacking one
    # of the pool's columns is an error naming it: tests/cluster/test_table_columns.py).
    table = pd.read_csv(DATA / "hospital_c" / "records.csv").drop(columns="worst_area")
    np.savez(tmp_path / "c.npz", x=table.drop(columns="diagnosis").to_numpy(), y=table["diagnosis"].to_numpy(str))
    owner = dataclasses.replace(hospitals().owners[2], data=DataSource("npz", str(tmp_path / "c.npz"), label="y"),
                                teachers=2, budget=OwnerBudget(20.0, directory=str(tmp_path)))
    config = hospitals(owners=(owner,), public=hospitals().public.anchored(str(PROJECT_ROOT)),
                       test=hospitals().test.anchored(str(PROJECT_ROOT)))
    with pytest.raises(OwnerRefused, match=r"owner hospital_c: its records are inputs \[29\], but the run's are the "
                                           r"public pool's 30 columns"):
        train_ensemble(config, progress=False)


@pytest.mark.parametrize("change, named", [
    ({"public": None}, "owners need a public pool and a test set"),
    ({"classes": ("a", "a")}, "classes must be distinct"),
])
def test_an_owners_config_that_cannot_run_is_a_config_error(change, named):
    with pytest.raises(ValueError, match=named):
        hospitals(**change)


def test_owner_sections_are_checked_when_the_config_loads():
    raw = load_yaml(HOSPITALS)
    raw["owners"][1]["name"] = raw["owners"][0]["name"]
    with pytest.raises(ConfigError, match="owner names must be distinct"):
        load_pipeline(raw)
    raw = load_yaml(HOSPITALS)
    raw["owners"][0]["resources"] = {"hospital_a": 1}  # placement by Ray resources is gone with the owners' Ray
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['resources'\]"):
        load_pipeline(raw)
    raw = load_yaml(HOSPITALS)
    del raw["owners"][0]["records"]
    with pytest.raises(ConfigError, match="owner hospital_a: declare its records"):
        load_pipeline(raw)
    raw = load_yaml(HOSPITALS)
    raw["aggregation"] = "trusted-aggregator"
    with pytest.raises(ConfigError, match="owners vote behind their gateways, in secure rounds"):
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
    assert lines[0].startswith("teachers: 30 behind the gateways {'hospital_a': ['127.0.0.1:")
    assert lines[1].startswith("student: ") and lines[2].startswith("guarantee ε = ")
    assert lines[3].startswith("owners (lifetime budgets): hospital_a: ε 20 lifetime, ")


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
