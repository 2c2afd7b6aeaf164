"""CSV and Parquet tables: one row per record, numeric input columns, an optional label column.

Read with pandas (pyarrow for Parquet). A missing, non-numeric or infinite input value makes
its row unusable (``RawData.unusable``, naming the column), never a silent NaN the model would
train on; whether that is an error or a dropped row is the caller's rule (``DataSource.read``).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from conclave.learning.data.dataset import DataFormatError
from conclave.learning.data.sources import DataSource, RawData


def read_csv(source: DataSource) -> RawData:
    try:
        frame = pd.read_csv(source.path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise DataFormatError(f"{source.path}: not a readable CSV table ({type(err).__name__}: "
                              f"{str(err).splitlines()[0]})") from None
    return table_data(frame, source)


def read_parquet(source: DataSource) -> RawData:
    import pyarrow

    try:
        frame = pd.read_parquet(source.path, engine="pyarrow")
    except (pyarrow.ArrowException, OSError) as err:
        raise DataFormatError(f"{source.path}: not a readable Parquet file ({str(err).splitlines()[0]})") from None
    return table_data(frame, source)


def table_data(frame: pd.DataFrame, source: DataSource) -> RawData:
    """Inputs from ``source.columns`` (default: all but the label), labels from ``source.label``."""
    names = [str(c) for c in frame.columns]
    frame.columns = names
    missing = [c for c in ([source.label] if source.label else []) + list(source.columns or ()) if c not in names]
    if missing:
        raise DataFormatError(f"{source.path}: no column(s) {missing}; the table has {names[:20]}")
    columns = list(source.columns) if source.columns else [c for c in names if c != source.label]
    if not columns:
        raise DataFormatError(f"{source.path}: no input columns")
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
