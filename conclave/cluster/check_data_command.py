"""``conclave check-data CONFIG --owner NAME``: an owner's look at its own data, on its own node.

A run never stops on, or says anything about, an owner's records: that would make its course
depend on one record outside any mechanism. So an owner's node drops unusable rows (a missing,
non-numeric or out-of-range value, a CSV line that is no record, a label outside the run's
classes) without a word, runs with fewer records than declared, and cuts its teachers' shards
down when it holds more (``actors.owners.OwnerSource``). This command shows the owner what a
run would do with its file.

It reads that owner's file in this process, by the public pool's column names and at its
image size as a run does (the pool's header, or one of its images, is read too), and prints to
this terminal only: run it on the owner's machine, outside any DP run. It starts no Ray and
writes nothing. Exit status: 0 when every row is usable, 1 when rows would be dropped, 2 when
the file or the config cannot be read.

It also warns when the usable rows hold none at all, or fewer of the run's classes than there
are (one class only, say): a run trains on them all the same, and its teachers or records can
then vote only for the classes they hold. That is the owner's to know, and a run never says it.
"""
from __future__ import annotations

import argparse
import os
from collections import Counter

from conclave.cluster.config import ConfigError, load_yaml
from conclave.cluster.owners import DataOwner
from conclave.cluster.pipelines import OwnersData, load_pipeline
from conclave.errors import ConclaveError, fail
from conclave.learning.data.dataset import shard_cap
from conclave.learning.data.sources import PublicReading, image_size, input_columns


class RowsDropped(ConclaveError):
    """The status when a run would drop rows of the owner's file (each is shown above it)."""

    exit_code = 1


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("config", help="the run's YAML config (its owners section names the file)")
    parser.add_argument("--owner", required=True, help="the owner whose data to check (yours)")


def main(args: argparse.Namespace) -> int:
    from conclave.cluster.owners import owner_data

    try:
        declared = load_pipeline(load_yaml(args.config)).owners_data()
        owner = _owner(declared, args.owner)
        classes = _classes(declared)
        reading = _reading(declared, classes)
        source = owner_data(owner, reading, os.getcwd())
        dataset, check = _read(source, classes, owner.name, reading.columns, declared)
    except (ValueError, OSError) as err:  # the config, a file, its format (ConfigError, DataFormatError)
        return fail(ConfigError(str(err).splitlines()[0]))
    print(f"owner {owner.name}: {source.describes}")
    print(f"  rows read: {check.rows}; usable: {check.kept}; dropped: {len(check.problems)}")
    for line in check.summary(limit=20).split("; ") if check.problems else ():
        print(f"    {line}")
    if check.filled:
        print(f"  rows kept with cells filled by the public pool's column means: {len(check.filled)}")
        for row, why in sorted(check.filled.items())[:5]:
            print(f"    row {row}: {why}")
    if not dataset.unlabeled and len(dataset):
        counts = Counter(dataset.y.tolist())
        print("  labels: " + ", ".join(f"{name} {counts.get(i, 0)}" for i, name in enumerate(classes)))
    for line in _class_warnings(dataset, classes):
        print(f"  warning: {line}")
    for line in _against_declared(owner, declared.teachers.get(owner.name), check.kept):
        print(f"  {line}")
    return RowsDropped.exit_code if check.problems else 0


def _class_warnings(dataset, classes: tuple[str, ...]) -> list[str]:
    """What the owner should know about the classes its usable rows hold: none at all, or fewer
    than the run's (a run goes on either way, and says nothing of it)."""
    if not len(dataset):
        return ["no usable rows: a run goes on, and your data teaches it nothing"]
    held = sorted(set(dataset.y.tolist()))
    if dataset.unlabeled or len(held) == len(classes):
        return []
    lacking = ", ".join(repr(classes[i]) for i in range(len(classes)) if i not in held)
    if len(held) == 1:
        return [f"every usable row is of class {classes[held[0]]!r}: what your data teaches a run is that class "
                f"alone (none of {lacking})"]
    return [f"your usable rows hold {len(held)} of the run's {len(classes)} classes: none of {lacking}"]


def _owner(declared: OwnersData, name: str) -> DataOwner:
    owners = declared.owners
    for owner in owners:
        if owner.name == name:
            return owner
    known = ", ".join(o.name for o in owners) or "none: this config has no owners section"
    raise ConfigError(f"no owner {name!r} in the config (owners: {known})")


def _read(source, classes: tuple[str, ...], name: str, columns: tuple[str, ...] | None, declared: OwnersData):
    """``source.read_private``, where a column the owner's table lacks is named as the public
    pool's (its header sets the run's inputs: the pool may be the file at fault)."""
    from conclave.learning.data.sources import MissingColumns

    try:
        return source.read_private(classes, name)
    except MissingColumns as err:
        pooled = [c for c in err.missing if c in (columns or ())]
        if not pooled:
            raise
        raise MissingColumns(f"{source.path}: no column(s) {pooled} of the public pool {declared.public.path}, "
                             "whose columns are the run's inputs", pooled) from None


def _reading(declared: OwnersData, classes: tuple[str, ...]) -> PublicReading:
    """How a run reads an owner's data, from the public pool alone as the run reads it: a table by
    the pool's columns with the pool's column means in unusable cells, images at the pool's size
    (or, with no pool, the test data's)."""
    from conclave.learning.data.schema import Standardiser

    here = os.getcwd()
    public = declared.public
    try:
        if public is None:  # e.g. sparse_finetune's public data is a benchmark: images at the test data's size
            test = declared.test
            return PublicReading(size=None if test is None else image_size(test.anchored(here)))
        public = public.anchored(here)
        columns = input_columns(public)
        if columns is None:
            return PublicReading(size=image_size(public))
        pool = public.by_name(columns).read(classes, "public")
        return PublicReading(columns, fill=tuple(Standardiser.of_public(pool).mean.tolist()))
    except OSError as err:
        raise ConfigError(f"an owner's data is read as the public pool says, and the pool cannot be read here "
                          f"({err})") from None


def _classes(declared: OwnersData) -> tuple[str, ...]:
    """The run's class list: the config's, or the public test data's labels, as a run takes it."""
    from conclave.learning.data.sources import class_names

    if declared.classes:
        return tuple(declared.classes)
    test = declared.test.anchored(os.getcwd())
    try:
        return class_names(test.read_raw().labels)
    except OSError as err:
        raise ConfigError(f"the class list comes from the test data, which cannot be read here ({err}); "
                          "declare classes in the config") from None


def _against_declared(owner: DataOwner, teachers: int | None, usable: int) -> list[str]:
    """What a run does with the usable records, given what the owner declared (and its
    ``teachers``, where the pipeline trains them)."""
    declared = owner.records
    if declared is None:
        return ["records: none declared (a run uses every usable record)"]
    lines = [f"records declared: {declared} (a public upper bound); usable here: {usable}"]
    if usable < declared:
        lines.append("fewer than declared: a run uses what there is (nothing about it leaves this node)")
    elif teachers is not None:
        lines.append(f"each of the {teachers} teachers keeps at most {shard_cap(declared, teachers)} records of "
                     "its shard, chosen at random here when it holds more")
    if teachers is None:
        lines.append("DP-SGD samples every usable record at the rate of the declared size: holding more "
                     "makes batches larger on average, the guarantee is the same")
    return lines
