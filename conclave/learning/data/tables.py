"""CSV and Parquet tables: one row per record, numeric input columns, an optional label column.

Read with pandas (pyarrow for Parquet). Inputs are selected by column name, in the order
``source.columns`` gives (a run gives every table the public pool's, ``DataSource.by_name``):
a file's own column order and its extra columns do not matter. A missing or non-numeric input
value, or one that is not finite as float32 (where the model sees it: ``1e39`` is finite in
float64 and infinite after the cast), makes its row unusable (``RawData.unusable``, naming the
column), never a silent NaN the model would train on; whether that is an error or a dropped row
is the caller's rule (``DataSource.read``). Where the source has public ``fill`` values (an
owner's table in a run: the pool's column means), such a cell takes its column's value instead
and the row is kept (``RawData.filled``), unless no cell of it is usable.

A CSV holds one record per line, whatever the other lines hold: a line with more fields than the
header, or with a quote that does not close on it, is one unusable row, and a line with fewer
fields has missing values. So no line can abort the read, shift the columns of the others (pandas
takes the first column for an index when the first record has one field too many) or swallow
the lines after it (a quoted field may hold commas and quotes, not line breaks). Bytes that are
not UTF-8 read as U+FFFD, which no number or class name holds. Blank lines are no records.
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np
import pandas as pd

from conclave.learning.data.dataset import DataFormatError
from conclave.learning.data.sources import DataSource, MissingColumns, RawData


def read_csv(source: DataSource) -> RawData:
    frame, malformed = _csv_records(source.path)
    return table_data(frame, source, malformed)


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


def table_data(frame: pd.DataFrame, source: DataSource, malformed: dict[int, str] | None = None) -> RawData:
    """Inputs from ``source.columns`` by name (default: all but the label), labels from ``source.label``;
    ``malformed``: rows that are unusable whatever their values (a CSV line that is no record)."""
    names = [str(c) for c in frame.columns]
    frame.columns = names
    columns = _input_columns(names, source)
    if source.fill is not None and len(source.fill) != len(columns):
        raise DataFormatError(f"{source.path}: {len(source.fill)} fill values for {len(columns)} input columns")
    inputs = frame[columns]
    # A value that is not a number becomes NaN here and makes its row unusable: a column's
    # dtype must not depend on one record's value.
    wide = np.stack([_numbers(inputs[c]) for c in columns], axis=1) if len(inputs) else np.zeros((0, len(columns)))
    with np.errstate(over="ignore"):  # past float32's range: inf, found below
        x = wide.astype(np.float32)
    bad = ~np.isfinite(x)
    absent = inputs.isna().to_numpy()
    unusable = dict(malformed or {})
    filled: dict[int, str] = {}

    def what(row: int, col: int) -> str:
        value = wide[row, col]
        kind = ("missing" if absent[row, col] else "non-numeric" if np.isnan(value) else
                "infinite or too large" if np.isinf(value) else "out-of-range (past float32's)")
        return f"{kind} value in column {columns[col]!r}"

    for row in np.flatnonzero(bad.any(axis=1)):
        row = int(row)
        if row in unusable:
            continue
        cols = np.flatnonzero(bad[row])
        if source.fill is None or len(cols) == len(columns):  # nothing to fill from, or nothing usable left
            unusable[row] = what(row, int(cols[0])) if source.fill is None else "no usable value in the row"
            continue
        x[row, cols] = np.asarray(source.fill, dtype=np.float32)[cols]  # public values: the row's own cells alone
        filled[row] = what(row, int(cols[0])) + (f" and {len(cols) - 1} more" if len(cols) > 1 else "")
    labels = frame[source.label].to_numpy() if source.label else None
    return RawData(x, labels, unusable, filled)


def _numbers(column: pd.Series) -> np.ndarray:
    """A column's values as float64, NaN where one is not a number. Value by value when pandas
    cannot convert the column at once (an integer past float64's range raises): one record's
    value must not stop the others from being read."""
    try:
        return pd.to_numeric(column, errors="coerce").to_numpy(dtype=np.float64)
    except OverflowError:
        return np.array([_number(value) for value in column], dtype=np.float64)


def _number(value: object) -> float:
    try:
        return float(pd.to_numeric(value, errors="coerce"))
    except OverflowError:
        return math.inf
    except (TypeError, ValueError):
        return math.nan


def _input_columns(names: list[str], source: DataSource) -> list[str]:
    """The input columns of a table whose header is ``names``; the label and every named column
    must be there."""
    missing = [c for c in ([source.label] if source.label else []) + list(source.columns or ()) if c not in names]
    if missing:
        has = f"the table has {names}" if len(names) <= 10 else f"not among the table's {len(names)} columns"
        raise MissingColumns(f"{source.path}: no column(s) {missing}; {has}", missing)
    columns = list(source.columns) if source.columns else [c for c in names if c != source.label]
    if not columns:
        raise DataFormatError(f"{source.path}: no input columns")
    return columns


def _csv(source: DataSource, rows: int | None = None) -> pd.DataFrame:
    """The CSV table's first ``rows`` as pandas reads them (0: the header alone)."""
    try:
        return pd.read_csv(source.path, nrows=rows, index_col=False, encoding_errors="replace")
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise DataFormatError(f"{source.path}: not a readable CSV table ({type(err).__name__}: "
                              f"{str(err).splitlines()[0]})") from None


def _csv_records(path: str) -> tuple[pd.DataFrame, dict[int, str]]:
    """The CSV table read one record per line, and the lines that are no record (row → why;
    their row is all missing values). Rows count the lines after the header that are not
    blank, so ``conclave check-data`` names a row as its owner would count it."""
    text = Path(path).read_bytes().decode("utf-8-sig", errors="replace")
    # A line ends at \n, \r\n or \r, as pandas reads it (str.splitlines would also split at form
    # feeds and Unicode separators, which pandas keeps inside a field); pandas skips blank lines.
    lines = [line for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n") if line.strip(" \t")]
    if not lines:
        raise DataFormatError(f"{path}: not a readable CSV table (no header)")
    try:
        width = len(next(csv.reader([lines[0]])))
    except csv.Error as err:
        raise DataFormatError(f"{path}: not a readable CSV table (its header: {err})") from None
    malformed = {}
    for row, line in enumerate(lines[1:]):
        if '"' in line or line.count(",") >= width:  # else a plain line of at most ``width`` fields
            lines[row + 1], fault = _record(line, width)
            if fault:
                malformed[row] = fault
    try:
        # low_memory=False: one pass infers each column's type, so no "mixed types" warning (which
        # would reach the driver's terminal) says that a record somewhere is not a number.
        frame = pd.read_csv(io.BytesIO("\n".join(lines).encode()), index_col=False, low_memory=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise DataFormatError(f"{path}: not a readable CSV table ({type(err).__name__}: "
                              f"{str(err).splitlines()[0]})") from None
    return frame, malformed


def _record(line: str, width: int) -> tuple[str, str | None]:
    """One line as pandas should read it — itself, or re-quoted so that it is exactly one row —
    and why it is no record of a table ``width`` columns wide (None: it is one). Too few fields
    are no fault: the absent ones are missing values."""
    if '"' not in line:  # the usual line: no quoting to get wrong
        count = line.count(",") + 1
        return (line, None) if count <= width else (_no_record(width), f"{count} fields where the header has {width}")
    try:
        fields = next(csv.reader([line + "\n"]))
    except csv.Error as err:  # e.g. a field past the csv module's size limit
        return _no_record(width), f"unreadable line ({err})"
    if fields and fields[-1].endswith("\n"):  # the line break was read into a quoted field
        return _no_record(width), "a quote that does not close on its line"
    if len(fields) > width:
        return _no_record(width), f"{len(fields)} fields where the header has {width}"
    out = io.StringIO()
    # Every field quoted: a field of spaces stays a field (pandas would skip the line as blank).
    csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="").writerow(fields)
    return out.getvalue(), None


def _no_record(width: int) -> str:
    """A line pandas reads as one row of ``width`` missing values (quoted: never a blank line)."""
    return ",".join(['""'] * width)


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
