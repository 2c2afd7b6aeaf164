"""CSV and Parquet tables: one row per record, numeric input columns, an optional label column.

Read with pandas (pyarrow for Parquet); a non-numeric or missing input value is an error
naming the column, not a silent NaN the model would train on.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from learning.data.dataset import DataFormatError
from learning.data.sources import DataSource, RawData


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
    text = [c for c in columns if not pd.api.types.is_numeric_dtype(inputs[c]) or pd.api.types.is_bool_dtype(inputs[c])]
    if text:
        raise DataFormatError(f"{source.path}: input column(s) {text[:5]} are not numeric")
    x = inputs.to_numpy(dtype=np.float64)
    bad = ~np.isfinite(x).all(axis=0)
    if bad.any():
        raise DataFormatError(f"{source.path}: column(s) {[c for c, b in zip(columns, bad) if b][:5]} "
                              "have missing or infinite values")
    labels = None
    if source.label:
        labels = frame[source.label].to_numpy()
        if pd.isna(labels).any():
            raise DataFormatError(f"{source.path}: label column {source.label!r} has missing values")
    return RawData(x.astype(np.float32), labels)
