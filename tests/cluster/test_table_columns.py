"""Tables by column name in a run: the public pool's columns are the schema, and the test table
and every owner's file are read by those names behind its gateway; image folders need no label.
The hospitals example (configs/hospitals.yaml) with hospital_b's columns shuffled is the
end-to-end case: its records are read exactly as the unshuffled ones are, and the run scores as
the example does."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import yaml
from PIL import Image

from conclave.cluster.config import load_yaml
from conclave.cluster.owners import PublicData
from conclave.cluster.pipelines import load_pipeline
from tests.conftest import PROJECT_ROOT

HOSPITALS = PROJECT_ROOT / "configs" / "hospitals.yaml"
DATA = PROJECT_ROOT / "examples" / "hospitals" / "data"


def hospital_b_as(tmp_path, name: str, change) -> str:
    """hospital_b's records, rewritten through pandas after ``change`` (so files differ only by it)."""
    path = tmp_path / f"{name}.csv"
    change(pd.read_csv(DATA / "hospital_b" / "records.csv")).to_csv(path, index=False)
    return str(path)


def shuffled(table: pd.DataFrame) -> pd.DataFrame:
    order = np.random.default_rng(7).permutation(table.columns)
    assert list(order) != list(table.columns)
    return table[order].assign(patient_id=np.arange(len(table)))  # an extra column, ignored


def config_file(tmp_path, hospital_b: str, **owner_b) -> str:
    raw = load_yaml(HOSPITALS)
    raw["owners"][1]["data"].update(path=hospital_b, **owner_b)
    path = tmp_path / f"hospitals-{len(list(tmp_path.glob('hospitals-*')))}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_the_test_table_is_read_by_the_pools_column_names(tmp_path):
    config = load_pipeline(load_yaml(HOSPITALS)).config
    public, test = config.public.anchored(str(PROJECT_ROOT)), config.test.anchored(str(PROJECT_ROOT))
    table = pd.read_csv(test.path)
    table[table.columns[::-1]].assign(note="seen at the front desk").to_csv(tmp_path / "test.csv", index=False)
    want = PublicData.read(public, test, None)
    got = PublicData.read(public, dataclasses.replace(test, path=str(tmp_path / "test.csv")), None)
    assert got.schema.columns == want.schema.columns == tuple(pd.read_csv(public.path, nrows=0).columns)
    np.testing.assert_array_equal(got.splits.test.x, want.splits.test.x)
    np.testing.assert_array_equal(got.splits.test.y, want.splits.test.y)


def test_a_pool_with_an_extra_column_is_reported_against_the_pool(tmp_path, capsys, monkeypatch):
    """The pool's header sets the run's inputs, so an extra column there is first missed in the
    test table: the one-line error names the pool first, and the test table, before Ray starts."""
    import ray

    from conclave.cluster import cli

    pool = tmp_path / "pool.csv"
    pd.read_csv(DATA / "public" / "unlabeled.csv").assign(ward=1.0).to_csv(pool, index=False)
    raw = load_yaml(HOSPITALS)
    raw["public"]["path"] = str(pool)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(PROJECT_ROOT)
    was_running = ray.is_initialized()
    assert cli.main(["run", str(path), "--results-dir", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"conclave: public/test: {pool}: the public pool's input column(s) ['ward'] are not in "
                          "the test table examples/hospitals/data/public/test.csv") and "\n" not in err
    assert ray.is_initialized() == was_running
    # an owner checking its data hears that the column is the pool's
    assert cli.main(["check-data", str(path), "--owner", "hospital_b"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"conclave: {DATA / 'hospital_b' / 'records.csv'}: no column(s) ['ward'] of the "
                   f"public pool {pool}, whose columns are the run's inputs")


def test_an_image_folder_test_split_needs_no_label_and_owners_are_read_at_the_pools_size(tmp_path, capsys):
    from conclave.cluster import cli
    from conclave.cluster.owners import owner_data

    rng = np.random.default_rng(0)
    for folder in ("owner/cat", "owner/dog", "pool", "test/cat", "test/dog"):
        (tmp_path / folder).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8)).save(tmp_path / folder / f"{i}.png")
    raw = {"pipeline": "teacher_student", "name": "images",
           "owners": [{"name": "clinic", "data": {"format": "images", "path": str(tmp_path / "owner")},
                       "teachers": 2, "records": 6}],
           "public": {"format": "images", "path": str(tmp_path / "pool")},
           "test": {"format": "images", "path": str(tmp_path / "test")},
           "student": {"queries": 3, "batch_size": 3, "checkpoints": []}}
    config = load_pipeline(raw).config  # no `label:` anywhere
    public = PublicData.read(config.public, config.test, config.classes)
    assert public.classes == ("cat", "dog") and public.schema.columns is None
    assert public.splits.test.y.tolist() == [0, 0, 0, 1, 1, 1]
    # an owner's image of another size is one dropped row, at the pool's size, in a run and check-data
    Image.fromarray(rng.integers(0, 256, (9, 9), dtype=np.uint8)).save(tmp_path / "owner" / "cat" / "0.png")
    source = owner_data(config.owners[0], public.reading, str(tmp_path))
    dataset, check = source.read_private(public.classes)
    assert source.size == (8, 8) and len(dataset) == 5 and list(check.problems) == [0]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    assert cli.main(["check-data", str(tmp_path / "run.yaml"), "--owner", "clinic"]) == 1
    assert "0.png: a 9×9 image, not the run's 8×8 (row 0)" in capsys.readouterr().out


def test_an_owners_explicit_columns_that_are_not_the_pools_fail_before_ray_starts(tmp_path, capsys, monkeypatch):
    from conclave.cluster import cli

    path = config_file(tmp_path, str(DATA / "hospital_b" / "records.csv"), columns=["mean_radius"])
    monkeypatch.chdir(PROJECT_ROOT)
    assert cli.main(["run", path, "--results-dir", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("conclave: owner hospital_b: columns ['mean_radius'] are not the public pool's "
                          "['mean_radius', 'mean_texture', ") and "\n" not in err
    assert not (tmp_path / "results").exists()


def test_an_owner_missing_a_column_is_one_line_naming_the_owner_and_the_column(ray_session, tmp_path, capsys,
                                                                                 monkeypatch):
    from conclave.cluster import cli

    lacking = hospital_b_as(tmp_path, "lacking", lambda t: shuffled(t).drop(columns="worst_area"))
    monkeypatch.chdir(PROJECT_ROOT)
    assert cli.main(["run", config_file(tmp_path, lacking), "--results-dir", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"conclave: run 'hospitals' refused: owner hospital_b: {lacking}: no column(s) ['worst_area']; "
                   "not among the table's 31 columns")


@pytest.mark.slow
def test_an_owner_with_its_columns_shuffled_teaches_as_it_would_unshuffled(ray_session, tmp_path, capsys,
                                                                           monkeypatch):
    """Before tables were read by name, hospital_b's teachers trained silently on scrambled
    features. Now its gateway's actors load the same records, shard for shard (``OwnerSource``, as
    the gateway reads the owner's file by the pool's columns), and a whole run with the shuffled
    file scores as the example does."""
    from conclave.actors.owners import OwnerSource
    from conclave.cluster import cli
    from conclave.cluster.teaching.ensemble import public_data

    monkeypatch.chdir(PROJECT_ROOT)
    shards = {}
    for name, change in (("plain", lambda t: t), ("shuffled", shuffled)):
        config = load_pipeline(load_yaml(config_file(tmp_path, hospital_b_as(tmp_path, name, change)))).config
        public = public_data(config)
        owner = config.owners[1]
        shards[name] = OwnerSource(owner.name, owner.data.read_as(public.reading), 10, public.classes).load(range(10))
    for plain, mixed in zip(shards["plain"], shards["shuffled"]):
        np.testing.assert_array_equal(mixed.x, plain.x)
        np.testing.assert_array_equal(mixed.y, plain.y)

    path = config_file(tmp_path, hospital_b_as(tmp_path, "run", shuffled))
    assert cli.main(["run", path, "--results-dir", str(tmp_path / "results")]) == 0, capsys.readouterr().err
    metrics = json.loads((tmp_path / "results" / "hospitals" / "metrics.json").read_text())
    # as tests/cluster/test_owners.py asks of the unshuffled example (majority class: 0.63)
    assert metrics["queries_answered"] > 0 and metrics["student_accuracy"] > 0.7
