"""CSV and Parquet tables: one row per record, numeric input columns, an optional label column.

Read with pandas (pyarrow for Parquet). Inputs are selected by column name, in the order
``source.columns`` gives (a run gives every table the public pool's, ``DataSource.by_name``):
a file's own column order and its extra columns do not matter. A missing, non-numeric or
infinite input value makes its row unusable (``RawData.unusable``, naming the column), never a
silent NaN the model would train on; whether that is an error or a dropped row is the caller's
rule (``DataSource.read``).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from conclave.learning.data.dataset import DataFormatError
from conclave.learning.data.sources import DataSource, RawData


def read_csv(source: DataSource) -> RawData:
    return table_data(_csv(source), source)


def read_parquet(source: DataSource) -> RawData:
    import pyarrow

    try:
        frame = pd.read_parquet(source.path, engine="pyarrow")
    except (pyarrow.ArrowException, OSError) as err:
        raise DataFormatError(f"{source.path}: not a readable Parquet file ({str(err).splitlines()[0]})") from None
    return table_data(frame, source)


def table_input_columns(source: DataSource) -> tuple[str, ...]:
    """The input columns ``source`` reads, from the table's header alone (no record is read)."""
    names = list(_csv(source, rows=0).columns) if source.format == "csv" else _parquet_columns(source)
    return tuple(_input_columns([str(c) for c in names], source))


def table_data(frame: pd.DataFrame, source: DataSource) -> RawData:
    """Inputs from ``source.columns`` by name (default: all but the label), labels from ``source.label``."""
    names = [str(c) for c in frame.columns]
    frame.columns = names
    columns = _input_columns(names, source)
    inputs = frame[columns]
    # A value that is not a number becomes NaN here and makes its row unusable: a column's
    # dtype must not depend on one record's value.
    x = inputs.apply(pd.to_numeric, errors="coerce").to_numpy(dtype=np.float64, copy=True)
    bad = ~np.isfinite(x)
    absent = inputs.isna().to_numpy()
    unusable = {}
    for row in np.flatnonzero(bad.any(axis=1)):
        col = int(np.argmax(bad[row]))
        what = "missing" if absent[row, col] else "non-numeric" if np.isnan(x[row, col]) else "infinite"
        unusable[int(row)] = f"{what} value in column {columns[col]!r}"
    x[bad.any(axis=1)] = 0.0
    labels = frame[source.label].to_numpy() if source.label else None
    return RawData(x.astype(np.float32), labels, unusable)


def _input_columns(names: list[str], source: DataSource) -> list[str]:
    """The input columns of a table whose header is ``names``; the label and every named column
    must be there."""
    missing = [c for c in ([source.label] if source.label else []) + list(source.columns or ()) if c not in names]
    if missing:
        has = f"the table has {names}" if len(names) <= 10 else f"not among the table's {len(names)} columns"
        raise DataFormatError(f"{source.path}: no column(s) {missing}; {has}")
    columns = list(source.columns) if source.columns else [c for c in names if c != source.label]
    if not columns:
        raise DataFormatError(f"{source.path}: no input columns")
    return columns


def _csv(source: DataSource, rows: int | None = None) -> pd.DataFrame:
    """The CSV table (``rows``: only its first rows; 0: the header alone)."""
    try:
        return pd.read_csv(source.path, nrows=rows)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise DataFormatError(f"{source.path}: not a readable CSV table ({type(err).__name__}: "
                              f"{str(err).splitlines()[0]})") from None


def _parquet_columns(source: DataSource) -> list[str]:
    """A Parquet file's columns as pandas reads them (its stored index is not one of them)."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(source.path)
    except (pyarrow.ArrowException, OSError) as err:
        raise DataFormatError(f"{source.path}: not a readable Parquet file ({str(err).splitlines()[0]})") from None
    index = {c for c in (schema.pandas_metadata or {}).get("index_columns", []) if isinstance(c, str)}
    return [name for name in schema.names if name not in index]
