"""Data sources in each format, written here as small real files, read into one Dataset layout."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from conclave.learning.data.dataset import UNLABELED, DataFormatError
from conclave.learning.data.sources import DataSource, PublicReading, class_names, image_size

CLASSES = ("cat", "dog", "eel")


def table(rows: int = 6) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame({"age": rng.integers(20, 90, rows), "weight": rng.normal(70, 9, rows),
                         "kind": [CLASSES[i % 3] for i in range(rows)]})


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_table_reads_its_numeric_columns_and_maps_labels_onto_the_class_list(tmp_path, fmt):
    frame = table()
    path = tmp_path / f"t.{fmt}"
    frame.to_csv(path, index=False) if fmt == "csv" else frame.to_parquet(path, index=False)
    dataset = DataSource(fmt, str(path), label="kind").read(CLASSES)
    assert dataset.x.dtype == np.float32 and dataset.input_shape == (2,) and not dataset.is_image
    np.testing.assert_allclose(dataset.x, frame[["age", "weight"]].to_numpy(), rtol=1e-6)
    assert dataset.y.tolist() == [0, 1, 2, 0, 1, 2] and dataset.num_classes == 3
    only_age = DataSource(fmt, str(path), label="kind", columns=("age",)).read(CLASSES)
    assert only_age.input_shape == (1,)
    unlabeled = DataSource(fmt, str(path), columns=("age", "weight")).read(CLASSES)
    assert unlabeled.unlabeled and (unlabeled.y == UNLABELED).all()


def test_table_errors_name_the_file_and_the_column(tmp_path):
    frame = table()
    frame["note"] = "x"
    frame.to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(DataFormatError, match=r"t.csv: non-numeric value in column 'note' \(rows 0, 1, 2 and 3 more\)"):
        DataSource("csv", str(tmp_path / "t.csv"), label="kind").read(CLASSES)
    with pytest.raises(DataFormatError, match=r"no column\(s\) \['diagnosis'\]"):
        DataSource("csv", str(tmp_path / "t.csv"), label="diagnosis").read(CLASSES)
    with pytest.raises(DataFormatError, match=r"label 'eel' not among the classes \['cat', 'dog'\]"):
        DataSource("csv", str(tmp_path / "t.csv"), label="kind", columns=("age",)).read(("cat", "dog"))
    frame = table()
    frame.loc[2, "weight"] = np.nan
    frame.to_csv(tmp_path / "gap.csv", index=False)
    with pytest.raises(DataFormatError, match=r"gap.csv: missing value in column 'weight' \(row 2\)"):
        DataSource("csv", str(tmp_path / "gap.csv"), label="kind").read(CLASSES)
    (tmp_path / "not.parquet").write_text("a,b\n1,2\n")
    with pytest.raises(DataFormatError, match="not a readable Parquet file"):
        DataSource("parquet", str(tmp_path / "not.parquet")).read(CLASSES)
    with pytest.raises(FileNotFoundError, match="gone.csv: no such file or folder"):
        DataSource("csv", str(tmp_path / "gone.csv")).read(CLASSES)


def test_npz_and_npy_arrays_as_tables_and_as_images(tmp_path):
    rows = np.arange(12, dtype=np.float64).reshape(4, 3)
    np.savez(tmp_path / "t.npz", x=rows, y=np.array([0, 2, 1, 0]))
    dataset = DataSource("npz", str(tmp_path / "t.npz"), label="y").read(("0", "1", "2"))
    assert dataset.input_shape == (3,) and dataset.y.tolist() == [0, 2, 1, 0]
    images = np.random.default_rng(1).integers(0, 256, (5, 6, 6), dtype=np.uint8)  # [n, H, W] bytes
    np.save(tmp_path / "x.npy", images)
    np.save(tmp_path / "y.npy", np.array([1, 1, 0, 1, 0]))
    dataset = DataSource("npy", str(tmp_path / "x.npy"), label=str(tmp_path / "y.npy")).read(("0", "1"))
    assert dataset.is_image and dataset.input_shape == (1, 6, 6)
    np.testing.assert_allclose(dataset.x[:, 0], images / 255.0, rtol=1e-6)
    with pytest.raises(DataFormatError, match=r"needs arrays \['x', 'labels'\]; it holds \['x', 'y'\]"):
        DataSource("npz", str(tmp_path / "t.npz"), label="labels").read(("0", "1", "2"))
    np.save(tmp_path / "big.npy", np.full((2, 1, 4, 4), 3.0))
    with pytest.raises(DataFormatError, match=r"pixel outside \[0, 1\] \(store uint8 images to have them scaled\) \(rows 0, 1\)"):
        DataSource("npy", str(tmp_path / "big.npy")).read(("0",))
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(DataFormatError, match="not a readable .npy array"):  # no pickles: no code from a file
        DataSource("npy", str(tmp_path / "objects.npy")).read(("0",))


def test_an_image_folder_reads_one_class_per_subfolder(tmp_path):
    rng = np.random.default_rng(2)
    for name, count in (("cat", 2), ("dog", 3)):
        (tmp_path / "train" / name).mkdir(parents=True)
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, (7, 5, 3), dtype=np.uint8)).save(tmp_path / "train" / name / f"{i}.png")
    gray = DataSource("images", str(tmp_path / "train")).read(("cat", "dog"))
    assert gray.is_image and gray.input_shape == (1, 7, 5) and gray.y.tolist() == [0, 0, 1, 1, 1]
    rgb = DataSource("images", str(tmp_path / "train"), channels=3).read(("cat", "dog"))
    saved = np.asarray(Image.open(tmp_path / "train" / "dog" / "0.png"))
    np.testing.assert_allclose(rgb.x[2], saved.transpose(2, 0, 1) / 255.0, rtol=1e-6)
    (tmp_path / "pool").mkdir()
    Image.fromarray(rng.integers(0, 256, (7, 5), dtype=np.uint8)).save(tmp_path / "pool" / "a.png")
    assert DataSource("images", str(tmp_path / "pool")).read(("cat", "dog")).unlabeled
    Image.fromarray(rng.integers(0, 256, (9, 9), dtype=np.uint8)).save(tmp_path / "pool" / "b.png")
    with pytest.raises(DataFormatError, match="images of different sizes"):
        DataSource("images", str(tmp_path / "pool")).read(("cat", "dog"))
    with pytest.raises(DataFormatError, match=r"b.png: a 9×9 image, not the run's 7×5 \(row 1\)"):
        DataSource("images", str(tmp_path / "pool"), size=(7, 5)).read(("cat", "dog"))
    assert image_size(DataSource("images", str(tmp_path / "pool"))) == (7, 5)  # the first image's
    assert DataSource("images", str(tmp_path / "pool")).sized((9, 9)).size == (9, 9)
    with pytest.raises(ValueError, match=r"size \[7, 5\] is not the public pool's \[9, 9\]"):
        DataSource("images", str(tmp_path / "pool"), size=(7, 5)).sized((9, 9))
    (tmp_path / "pool" / "b.png").unlink()
    (tmp_path / "pool" / "c.png").write_text("not an image")
    with pytest.raises(DataFormatError, match="c.png: not a readable image"):
        DataSource("images", str(tmp_path / "pool")).read(("cat", "dog"))


def test_a_benchmark_is_a_source_too():
    train = DataSource("digits", split="train").read(tuple(str(c) for c in range(10)))
    assert train.input_shape == (1, 8, 8) and len(train) == 1297


def test_class_names_sort_numbers_as_numbers_and_anchoring_touches_no_file(tmp_path):
    assert class_names(np.array([10, 2, 1, 2])) == ("1", "2", "10")
    assert class_names(np.array([1.0, 0.0])) == ("0", "1")
    assert class_names(np.array(["b", "a"])) == ("a", "b")
    source = DataSource("npy", "x.npy", label="y.npy").anchored("/owner/data")
    assert (source.path, source.label) == ("/owner/data/x.npy", "/owner/data/y.npy")
    assert DataSource("csv", "/abs/t.csv", label="y").anchored("/else").path == "/abs/t.csv"


def test_an_owners_unusable_rows_are_dropped_and_told_only_to_the_caller(tmp_path):
    """``read_private`` (an owner's node) drops what ``read`` (public data) refuses, and returns
    what it dropped, row by row, for ``conclave check-data``."""
    frame = table()
    frame.loc[1, "weight"] = np.nan
    frame["age"] = frame["age"].astype(object)
    frame.loc[2, "age"] = "old"
    frame.loc[4, "kind"] = "fox"
    frame.to_csv(tmp_path / "t.csv", index=False)
    source = DataSource("csv", str(tmp_path / "t.csv"), label="kind")
    dataset, check = source.read_private(CLASSES)
    assert len(dataset) == check.kept == 3 and check.rows == 6
    assert check.problems == {1: "missing value in column 'weight'", 2: "non-numeric value in column 'age'",
                              4: "label 'fox' not among the classes ['cat', 'dog', 'eel']"}
    np.testing.assert_allclose(dataset.x[:, 0], frame.loc[[0, 3, 5], "age"].astype(float))
    with pytest.raises(DataFormatError, match="missing value in column 'weight' \\(row 1\\)"):
        source.read(CLASSES)
    frame.iloc[:0].to_csv(tmp_path / "empty.csv", index=False)  # no records at all: a run goes on
    empty, check = DataSource("csv", str(tmp_path / "empty.csv"), label="kind").read_private(CLASSES)
    assert len(empty) == 0 and empty.input_shape == (2,) and check.rows == 0
    with pytest.raises(DataFormatError, match="no records"):
        DataSource("csv", str(tmp_path / "empty.csv"), label="kind").read(CLASSES)
    images = np.full((3, 1, 2, 2), 0.5, dtype=np.float32)
    images[1, 0, 0, 0] = np.inf
    np.save(tmp_path / "x.npy", images)
    kept, check = DataSource("npy", str(tmp_path / "x.npy")).read_private(("0",))
    assert len(kept) == 2 and check.problems == {1: "NaN or infinite value"}


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_an_owners_unusable_cells_take_the_public_fill_and_only_an_empty_row_is_dropped(tmp_path, fmt):
    """Imputation reads no statistic of the owner's: each unusable cell takes the public value given
    for its column (a run's: the pool's mean), so a row is its own function; adding a flawed row
    changes no other row."""
    frame = table().astype({"age": object})
    frame.loc[1, "age"] = None  # missing
    frame.loc[2, "age"] = "old"  # not a number
    frame.loc[3, ["age", "weight"]] = [None, None]  # nothing usable: dropped
    path = tmp_path / f"t.{fmt}"
    frame.to_csv(path, index=False) if fmt == "csv" else frame.astype({"age": str}).to_parquet(path, index=False)
    reading = PublicReading(("weight", "age"), fill=(-7.0, 1000.0))  # far from anything the owner holds
    source = DataSource(fmt, str(path), label="kind").read_as(reading)
    dataset, check = source.read_private(CLASSES)
    assert check.problems == {3: "no usable value in the row"} and sorted(check.filled) == [1, 2]
    assert check.filled[2] == "non-numeric value in column 'age'"
    assert dataset.x[:, 1].tolist()[1:3] == [1000.0, 1000.0]  # the public fill, not the owner's mean
    kept = frame.drop(index=[1, 2, 3])
    np.testing.assert_allclose(np.delete(dataset.x, [1, 2], axis=0), kept[["weight", "age"]].astype(float), rtol=1e-6)
    # without a fill (public data, or a source read as declared) the same rows are unusable, as before
    _, as_declared = DataSource(fmt, str(path), label="kind").read_private(CLASSES)
    assert sorted(as_declared.problems) == [1, 2, 3] and not as_declared.filled
    with pytest.raises(ValueError, match="fill is a table's finite public value"):
        DataSource("images", str(tmp_path), fill=(0.0,))
