"""Tables are read by column name: a file's own column order and its extra columns do not change
what is read, and a missing column is an error naming it."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from conclave.learning.data.dataset import DataFormatError, Dataset
from conclave.learning.data.schema import InputSchema
from conclave.learning.data.sources import DataSource, input_columns

CLASSES = ("benign", "malignant")


def records(rows: int = 12) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({name: rng.normal(10 * i, 1 + i, rows) for i, name in enumerate("abcd")})
    frame["diagnosis"] = [CLASSES[i % 2] for i in range(rows)]
    return frame


def write(frame: pd.DataFrame, path, fmt: str) -> str:
    frame.to_csv(path, index=False) if fmt == "csv" else frame.to_parquet(path, index=False)
    return str(path)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_table_with_its_columns_permuted_reads_to_the_same_array(tmp_path, fmt):
    frame = records()
    plain = write(frame, tmp_path / f"plain.{fmt}", fmt)
    shuffled = frame[["diagnosis", "c", "a", "d", "b"]].assign(patient_id=np.arange(len(frame)) + 1000)
    other = write(shuffled, tmp_path / f"shuffled.{fmt}", fmt)
    columns = input_columns(DataSource(fmt, plain, label="diagnosis"))  # the header alone
    assert columns == ("a", "b", "c", "d")
    want = DataSource(fmt, plain, label="diagnosis").by_name(columns).read(CLASSES)
    got, check = DataSource(fmt, other, label="diagnosis").by_name(columns).read_private(CLASSES)
    np.testing.assert_array_equal(got.x, want.x)
    np.testing.assert_array_equal(got.y, want.y)
    assert not check.problems  # the extra column is not read at all
    np.testing.assert_allclose(want.x, frame[list("abcd")].to_numpy(), rtol=1e-6)


def test_a_missing_column_is_an_error_naming_it(tmp_path):
    path = write(records().drop(columns="c"), tmp_path / "b.csv", "csv")
    source = DataSource("csv", path, label="diagnosis").by_name(("a", "b", "c", "d"))
    # an owner's read drops flawed rows silently, but a column of the schema is not a record
    with pytest.raises(DataFormatError, match=r"b.csv: no column\(s\) \['c'\]; the table has \['a', 'b', 'd', "
                                              r"'diagnosis'\]$"):
        source.read_private(CLASSES)


def test_explicit_columns_must_be_the_schemas_and_are_read_in_its_order(tmp_path):
    schema = ("a", "b", "c", "d")
    reordered = DataSource("csv", "t.csv", label="diagnosis", columns=("d", "c", "b", "a")).by_name(schema)
    assert reordered.columns == schema
    with pytest.raises(ValueError, match=r"columns \['a', 'b'\] are not the public pool's \['a', 'b', 'c', 'd'\]"):
        DataSource("csv", "t.csv", columns=("a", "b")).by_name(schema)
    arrays = DataSource("npz", "t.npz", label="y")
    assert arrays.by_name(schema) is arrays and input_columns(arrays) is None  # arrays have no names
    path = write(records(), tmp_path / "t.csv", "csv")
    assert input_columns(DataSource("csv", path, label="diagnosis", columns=("b", "a"))) == ("b", "a")


def test_the_input_schema_carries_a_tables_column_names():
    table = Dataset(np.zeros((3, 2), dtype=np.float32), np.zeros(3, dtype=np.int64), 2, "t")
    schema = InputSchema.of(table, ("age", "weight"))
    assert schema.columns == ("age", "weight") and schema.describe().endswith("columns age, weight")
    with pytest.raises(ValueError, match="3 column names do not fit table inputs of shape"):
        InputSchema.of(table, ("age", "weight", "height"))
    assert InputSchema.of(table).columns is None
