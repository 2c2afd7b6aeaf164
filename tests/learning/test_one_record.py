"""One record, edited in any way a reader or the float32 cast can refuse, changes nothing but
itself: ``read_private`` never raises, the usable records are the others exactly (same values,
same labels), and the edited record is reported in the owner's ``RowCheck`` alone. ``read``
(public data) refuses the same file, naming it and the row.

Each format starts from a small valid owner file; each edit touches one record (at the start,
the middle and the end of the file) or adds or removes one."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from conclave.learning.data.dataset import DataFormatError, Dataset
from conclave.learning.data.sources import DataSource

CLASSES = ("cat", "dog", "eel")
ROWS = 8
POSITIONS = (0, ROWS // 2, ROWS - 1)


def owner_table() -> pd.DataFrame:
    """Integers, floats of every magnitude and sign, and string labels."""
    rng = np.random.default_rng(5)
    return pd.DataFrame({"age": rng.integers(20, 90, ROWS),
                         "weight": rng.normal(0, 1, ROWS) * 10.0 ** rng.integers(-30, 30, ROWS),
                         "score": rng.normal(70, 9, ROWS).round(3),
                         "kind": [CLASSES[i % 3] for i in range(ROWS)]})


def records(dataset: Dataset) -> list[tuple[bytes, int]]:
    """Each usable record as its exact bytes and label, in file order."""
    return [(row.tobytes(), int(label)) for row, label in zip(dataset.x, dataset.y)]


@dataclass(frozen=True)
class Outcome:
    """What an edit must do: the base records still usable, unchanged (indices, in file order),
    and the rows the owner is told were dropped. ``rewritten``: the edited record's row when it
    may still be read, as a new value (``either``: or be dropped, as ``dropped`` says; a spelling
    such as " 12" may or may not be read as a number — by its own text alone)."""

    kept: list[int]
    dropped: set[int]
    rewritten: int | None = None
    either: bool = False


def check(source: DataSource, base: list[tuple[bytes, int]], outcome: Outcome, what: str,
          classes: tuple[str, ...] = CLASSES) -> None:
    dataset, found = source.read_private(classes)  # never raises
    got = records(dataset)
    r = outcome.rewritten
    if r is not None and (len(got) > len(outcome.kept) or not outcome.either):
        assert got[:r] + got[r + 1:] == [base[i] for i in outcome.kept], what  # nothing else changed
        assert got[r][1] == base[r][1] and not found.problems, (what, found.problems)
        return
    assert got == [base[i] for i in outcome.kept], what
    assert set(found.problems) == outcome.dropped and all(found.problems.values()), (what, found.problems)
    if found.problems:
        with pytest.raises(DataFormatError, match=rf"{source.path}: .*\(rows? {min(outcome.dropped)}"):
            source.read(classes)


def others(r: int, total: int = ROWS) -> list[int]:
    return [i for i in range(total) if i != r]


# --- CSV: edits of the text itself -------------------------------------------------------------

COLUMN = {"age": 0, "weight": 1, "score": 2, "kind": 3}


def field(column: str, value: bytes) -> Callable[[list[bytes]], list[bytes]]:
    def edit(fields: list[bytes]) -> list[bytes]:
        return fields[:COLUMN[column]] + [value] + fields[COLUMN[column] + 1:]
    return edit


DROPPED_VALUES = [b"1e39", b"-1e39", b"1e300", b"-1e300", b"3.5e38", b"1e400", b"9" * 400, b"nan", b"NaN", b"NAN",
                  b"-nan", b"inf", b"-inf", b"+inf", b"Infinity", b"-Infinity", b"INF", b"NA", b"N/A", b"null",
                  b"None", b"", b"  ", b"abc", b"12.5.3", b"1e", b"--1", b"0x10", b'12"5', b'"12.5', b'"12,5"',
                  b'"1""2"', b"12\xff5", b"\xc3", b"12\x005", b'"' + b"9" * 200_000 + b'"', b"age"]
EITHER_VALUES = [b"1_000", "\uff19".encode(), b" 12", b"12 ", b"+12"]  # read as a number or not, per record
KEPT_VALUES = [b"1e5", b"0012", b"-0.0", b"1e-50", b"1e-40"]  # valid, if odd: read as numbers
DROPPED_LABELS = [b"fox", b"", b"NA", b"1e300", b"Cat", b"cat ", b"c\xffat", b'"cat', b"9" * 400]


def line_edits(r: int) -> dict[str, tuple[Callable[[list[bytes]], list[bytes]], Outcome]]:
    """Edits of the line of record ``r``: name → (lines → lines, outcome)."""
    def of_fields(change: Callable[[list[bytes]], list[bytes]]) -> Callable[[list[bytes]], list[bytes]]:
        def edit(lines: list[bytes]) -> list[bytes]:
            lines = list(lines)
            lines[1 + r] = b",".join(change(lines[1 + r].split(b",")))
            return lines
        return edit

    def of_line(change: Callable[[bytes], bytes]) -> Callable[[list[bytes]], list[bytes]]:
        def edit(lines: list[bytes]) -> list[bytes]:
            return lines[:1 + r] + [change(lines[1 + r])] + lines[2 + r:]
        return edit

    dropped, removed, same = Outcome(others(r), {r}), Outcome(others(r), set()), Outcome(list(range(ROWS)), set())
    either = Outcome(others(r), {r}, rewritten=r, either=True)
    edits = {}
    for column in ("age", "weight"):
        for value in DROPPED_VALUES:
            edits[f"{column}={value[:12]!r}"] = (of_fields(field(column, value)), dropped)
        for value in EITHER_VALUES:
            edits[f"{column}={value!r}"] = (of_fields(field(column, value)), either)
    for value in KEPT_VALUES:
        edits[f"weight={value!r}"] = (of_fields(field("weight", value)), Outcome(others(r), set(), rewritten=r))
    for value in DROPPED_LABELS:
        edits[f"kind={value[:12]!r}"] = (of_fields(field("kind", value)), dropped)
    edits.update({
        "quoted values": (of_fields(lambda f: [b'"' + v + b'"' for v in f]), same),
        "an extra field": (of_line(lambda line: line + b",9"), dropped),
        "a trailing comma": (of_line(lambda line: line + b","), dropped),
        "two extra fields": (of_line(lambda line: line + b",9,9"), dropped),
        "no label field": (of_fields(lambda f: f[:-1]), dropped),
        "a field less": (of_fields(lambda f: f[1:]), dropped),
        "only commas": (of_line(lambda line: b",,,"), dropped),
        "an empty line": (of_line(lambda line: b""), removed),
        "a line of blanks": (of_line(lambda line: b"  \t "), removed),
        "the header again": (of_line(lambda line: b"age,weight,score,kind"), dropped),
        "a stray quote first": (of_line(lambda line: b'"' + line), dropped),
        "a stray quote last": (of_line(lambda line: line + b'"'), dropped),
        "a line of a quote": (of_line(lambda line: b'"'), dropped),
        "a NUL byte": (of_line(lambda line: line.replace(b",", b"\x00,", 1)), either),
        "a form feed": (of_line(lambda line: line.replace(b",", b"\x0c,", 1)), either),
        "removed": (lambda lines: lines[:1 + r] + lines[2 + r:], removed),
        "a blank line before": (lambda lines: lines[:1 + r] + [b""] + lines[1 + r:], same),
    })
    return edits


def added_lines() -> dict[str, tuple[Callable[[list[bytes]], list[bytes]], Outcome]]:
    """Edits that add one record at the end."""
    grown = Outcome(list(range(ROWS)), {ROWS})
    return {
        "an added line with an extra field": (lambda lines: lines + [lines[1] + b",1"], grown),
        "an added line past float32": (lambda lines: lines + [b"30,1e39,1,cat"], grown),
        "an added line with an open quote": (lambda lines: lines + [b'30,"1,1,cat'], grown),
        "a duplicate of another record": (lambda lines: lines + [lines[3]], Outcome([*range(ROWS), 2], set())),
    }


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
def test_one_edited_csv_line_changes_only_its_own_record(tmp_path, ending):
    original = tmp_path / "owner.csv"
    owner_table().to_csv(original, index=False)
    lines = original.read_bytes().splitlines()
    base = records(DataSource("csv", str(original), label="kind").read(CLASSES))
    assert len(base) == ROWS
    cases = [(f"{name} at record {r}", edit, outcome)
             for r in POSITIONS for name, (edit, outcome) in line_edits(r).items()]
    cases += [(name, edit, outcome) for name, (edit, outcome) in added_lines().items()]
    for i, (what, edit, outcome) in enumerate(cases):
        path = tmp_path / f"edit{i}.csv"
        path.write_bytes(ending.join(edit(lines)) + (ending if i % 2 else b""))  # with and without a last line end
        check(DataSource("csv", str(path), label="kind"), base, outcome, what)


def test_a_value_past_float32_is_named_as_such_and_a_malformed_line_by_its_fields(tmp_path):
    """What ``conclave check-data`` shows the owner: the reason and the row, counted in file order."""
    path = tmp_path / "owner.csv"
    owner_table().to_csv(path, index=False)
    lines = path.read_bytes().splitlines()
    lines[2] = b"30,1e39,1.5,cat"
    lines[4] += b",7"
    lines[6] = b'30,"1.5,1.5,dog'
    path.write_bytes(b"\n".join(lines))
    _, found = DataSource("csv", str(path), label="kind").read_private(CLASSES)
    assert found.problems == {1: "out-of-range (past float32's) value in column 'weight'",
                              3: "5 fields where the header has 4", 5: "a quote that does not close on its line"}


def test_two_stray_quotes_do_not_swallow_the_records_between_them(tmp_path):
    """In CSV a quote may open a field that runs over line breaks: one record's stray quote
    would then swallow every record up to another's. A record is one line here."""
    path = tmp_path / "owner.csv"
    owner_table().to_csv(path, index=False)
    lines = path.read_bytes().splitlines()
    base = records(DataSource("csv", str(path), label="kind").read(CLASSES))
    lines[2], lines[6] = b'"' + lines[2], lines[6] + b'"'
    path.write_bytes(b"\n".join(lines))
    dataset, found = DataSource("csv", str(path), label="kind").read_private(CLASSES)
    assert set(found.problems) == {1, 5} and records(dataset) == [base[i] for i in (0, 2, 3, 4, 6, 7)]


# --- Parquet: edits of one record's typed values -----------------------------------------------

def frame_edits(r: int) -> dict[str, tuple[Callable[[pd.DataFrame], pd.DataFrame], Outcome]]:
    def set_value(column: str, value: object) -> Callable[[pd.DataFrame], pd.DataFrame]:
        def edit(frame: pd.DataFrame) -> pd.DataFrame:
            frame = frame.copy()
            # as a writer would store the column then: floats, or (None, text) objects
            frame[column] = frame[column].astype(np.float64 if isinstance(value, float) else object)
            frame.loc[r, column] = value
            return frame
        return edit

    dropped = Outcome(others(r), {r})
    edits = {f"weight={v!r}": (set_value("weight", v), dropped)
             for v in (np.nan, np.inf, -np.inf, 1e39, -1e39, 1e300, None)}
    edits.update({f"age={v!r}": (set_value("age", v), dropped) for v in (np.nan, 1e39)})
    edits.update({f"score={v!r}": (set_value("score", v), dropped) for v in ("abc", "1e39", "", None, "nan", " ")})
    edits.update({f"kind={v!r}": (set_value("kind", v), dropped) for v in ("fox", None, "", "Cat", "x" * 1000)})
    edits.update({
        "removed": (lambda frame: frame.drop(index=r).reset_index(drop=True), Outcome(others(r), set())),
        "duplicated": (lambda frame: pd.concat([frame, frame.iloc[[r]]], ignore_index=True),
                       Outcome([*range(ROWS), r], set())),
    })
    return edits


def test_one_edited_parquet_record_changes_only_itself(tmp_path):
    table = owner_table().assign(score=lambda t: t["score"].astype(str))  # one column stored as text
    table.to_parquet(tmp_path / "owner.parquet", index=False)
    base = records(DataSource("parquet", str(tmp_path / "owner.parquet"), label="kind").read(CLASSES))
    for r in POSITIONS:
        for i, (name, (edit, outcome)) in enumerate(frame_edits(r).items()):
            path = tmp_path / f"edit{r}-{i}.parquet"
            edit(table).to_parquet(path, index=False)
            check(DataSource("parquet", str(path), label="kind"), base, outcome, f"{name} at record {r}")


# --- npz and npy: edits of one row of an array ---------------------------------------------------

ARRAY_CLASSES = ("0", "1", "2")


def test_one_edited_array_row_changes_only_itself(tmp_path):
    """Table rows and float images in ``.npz`` and ``.npy``, with integer and float labels."""
    rng = np.random.default_rng(9)
    rows = rng.normal(0, 1, (ROWS, 3)) * 10.0 ** rng.integers(-30, 30, (ROWS, 3))
    images = rng.random((ROWS, 1, 4, 4))
    labels = np.arange(ROWS) % 3
    values = {"rows": (np.nan, np.inf, -np.inf, 1e39, -1e39, 1e300, -1e300),
              "images": (np.nan, np.inf, 1e39, 1.5, -0.1, 1.0000001)}
    bad_labels = (7, -1, np.nan, 1e300, 1.5, np.inf)

    def sources(x: np.ndarray, y: np.ndarray, name: str) -> list[DataSource]:
        np.savez(tmp_path / f"{name}.npz", x=x, y=y)
        np.save(tmp_path / f"{name}.x.npy", x)
        np.save(tmp_path / f"{name}.y.npy", y)
        return [DataSource("npz", str(tmp_path / f"{name}.npz"), label="y"),
                DataSource("npy", str(tmp_path / f"{name}.x.npy"), label=str(tmp_path / f"{name}.y.npy"))]

    for kind, x in (("rows", rows), ("images", images)):
        for y in (labels, labels.astype(np.float64)):
            base = records(sources(x, y, "base")[0].read(ARRAY_CLASSES))
            assert records(sources(x, y, "base")[1].read(ARRAY_CLASSES)) == base
            for r in POSITIONS:
                cases: list[tuple[str, np.ndarray, np.ndarray, Outcome]] = []
                for value in values[kind]:
                    edited = x.copy()
                    edited[r].flat[1] = value
                    cases.append((f"x={value!r}", edited, y, Outcome(others(r), {r})))
                for label in bad_labels if y.dtype.kind == "f" else bad_labels[:2]:
                    edited_y = y.copy()
                    edited_y[r] = label
                    cases.append((f"y={label!r}", x, edited_y, Outcome(others(r), {r})))
                cases.append(("removed", np.delete(x, r, 0), np.delete(y, r), Outcome(others(r), set())))
                cases.append(("duplicated", np.concatenate([x, x[[r]]]), np.concatenate([y, y[[r]]]),
                              Outcome([*range(ROWS), r], set())))
                for what, edited_x, edited_y, outcome in cases:
                    for source in sources(edited_x, edited_y, "edit"):
                        check(source, base, outcome, f"{kind} {y.dtype} {source.format}: {what} at record {r}",
                              ARRAY_CLASSES)


# --- an image folder: one file edited, added or removed ------------------------------------------

def _another_class(root) -> None:
    (root / "fox").mkdir()
    shutil.move(root / "dog" / "1.png", root / "fox" / "1.png")


def _resized(height: int, width: int) -> Callable:
    def edit(root) -> None:
        Image.new("L", (width, height), 128).save(root / "dog" / "1.png")
    return edit


def _added(height: int, width: int) -> Callable:
    def edit(root) -> None:
        Image.new("L", (width, height), 128).save(root / "cat" / "9.png")
    return edit


def test_one_edited_image_changes_only_itself(tmp_path):
    """A file that is no image (text, truncated, empty), an image of another size than the run's
    or in a class folder outside the run's classes is one dropped row; a duplicate or a removal
    changes that record alone. The size is the run's (the public pool's), never the folder's:
    an odd image among the others, or one added, cannot decide which of them are kept."""
    rng = np.random.default_rng(4)
    base_dir = tmp_path / "base"
    for i in range(ROWS):
        (base_dir / CLASSES[i % 3]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (6, 5), dtype=np.uint8)).save(base_dir / CLASSES[i % 3] / f"{i}.png")
    base = records(DataSource("images", str(base_dir)).read(CLASSES))
    files = sorted(p.relative_to(base_dir).as_posix() for p in base_dir.rglob("*.png"))
    edited = base[files.index("dog/1.png")]
    rest = [record for record in base if record != edited]
    edits: dict[str, tuple[Callable, list, int]] = {  # name → (edit of the folder, usable records, dropped)
        "text": (lambda root: (root / "dog" / "1.png").write_text("not an image"), rest, 1),
        "truncated": (lambda root: (root / "dog" / "1.png").write_bytes((root / "dog" / "1.png").read_bytes()[:40]),
                      rest, 1),
        "empty": (lambda root: (root / "dog" / "1.png").write_bytes(b""), rest, 1),
        "another class": (_another_class, rest, 1),
        "removed": (lambda root: (root / "dog" / "1.png").unlink(), rest, 0),
        "duplicated": (lambda root: shutil.copy(root / "dog" / "1.png", root / "dog" / "9.png"), base + [edited], 0),
        "as RGBA": (lambda root: Image.open(root / "dog" / "1.png").convert("RGBA").save(root / "dog" / "1.png"),
                    base, 0),
        **{f"{h}x{w}": (_resized(h, w), rest, 1) for h, w in ((6, 6), (5, 5), (1, 1), (5, 6), (4000, 4000))},
        **{f"an added {h}x{w}": (_added(h, w), base, 1) for h, w in ((7, 5), (1, 1))},
    }
    for name, (edit, usable, dropped) in edits.items():
        root = tmp_path / name
        shutil.copytree(base_dir, root)
        edit(root)
        source = DataSource("images", str(root)).sized((6, 5))
        dataset, found = source.read_private(CLASSES)
        assert sorted(records(dataset)) == sorted(usable) and len(found.problems) == dropped, (name, found.problems)
        assert dataset.input_shape == (1, 6, 5), name


def test_an_owners_image_folder_is_read_at_a_given_size_only(tmp_path):
    """Without the run's size an owner's folder is not read: the size would come from its images."""
    (tmp_path / "cat").mkdir()
    Image.new("L", (5, 6)).save(tmp_path / "cat" / "0.png")
    with pytest.raises(DataFormatError, match="an owner's image folder is read at a given size"):
        DataSource("images", str(tmp_path)).read_private(CLASSES)
    (tmp_path / "cat" / "0.png").write_text("not an image")  # none readable: still one dropped row
    dataset, found = DataSource("images", str(tmp_path), size=(6, 5)).read_private(CLASSES)
    assert len(dataset) == 0 and dataset.input_shape == (1, 6, 5) and list(found.problems) == [0]
