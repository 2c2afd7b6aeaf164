"""The ``owners`` section every pipeline shares, and the public data the driver may read.

An owner names its data (a path read only behind its gateway, which the run starts on this machine:
``cluster.gateway.local``), its declared records and how many actors its part runs on; or it is
named by its gateway alone (below). Each pipeline adds what its owners do (e.g. teachers); the
driver itself reads only the ``public`` and ``test`` sources.

Tables are read by column name: the public pool's input columns are the run's schema
(``PublicData.schema.columns``), and the test table and every owner's file are read by those
names, in that order (``owner_data``): an owner's column order and extra columns do not matter,
and a column it lacks is one line naming the owner and the column, from its gateway. The
names are public (the pool's header), so they travel to the owners' gateways with the run's
terms, as does the pool's image size, at which an owner's image folder is read.

An owner may instead be named by its gateway alone (``{name, gateway: HOST:PORT}``, with the
coordinator's certificates in ``gateways``): its data, actors and ledger are then its own
business, on its machine, behind ``conclave owner serve`` (docs/gateway.md). Either way the
coordinator reaches it through the same owner protocol.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Sequence

from conclave.errors import InvalidValue
from conclave.learning.data.dataset import StudentSplits
from conclave.learning.data.schema import InputSchema, Standardiser
from conclave.learning.data.sources import DataSource, PublicReading, column_means, input_columns
from conclave.privacy.accounting.owner_policy import OwnerBudget


@dataclass(frozen=True)
class DataOwner:
    """One data owner: its data (a path on its machine, read behind the gateway the run starts for it
    there) and the actors its part runs on behind that gateway.

    ``records``: how many records the owner declares, a public upper bound: the
    run never checks it against the data (that would depend on one record). DP-SGD needs it:
    the sampling rate and the number of steps, which are released, come from the declared
    sizes, never from the private count; teachers keep at most their share of it.
    ``budget``: the lifetime budget the run asks for this data (``OwnerBudget``), kept in a ledger
    on its machine that every run charges before releasing anything computed from the data; where
    the owner wrote a policy there, the policy decides and this may only ask for less.
    ``gateway``: instead of all of these, the owner's gateway (host:port) on its own machine,
    which holds its data, actors, policy and ledger.
    """

    name: str
    data: DataSource | None = None  # None only beside a gateway
    actors: int = 1  # Ray actors the owner's part runs on, behind its gateway
    records: int | None = None
    budget: OwnerBudget | None = None
    gateway: str | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise InvalidValue(f"owner name {self.name!r}: use letters, digits, '-' and '_'")
        if self.gateway is not None:
            self._check_gateway()
            return
        if self.data is None:
            raise InvalidValue(f"owner {self.name}: give its data (or its gateway, host:port)")
        if self.actors < 1:
            raise InvalidValue(f"owner {self.name}: actors must be >= 1")
        if self.records is not None and self.records < self.actors:
            raise InvalidValue(f"owner {self.name}: {self.actors} actors need at least as many records "
                             f"(it declares {self.records})")

    def _check_gateway(self) -> None:
        given = [key for key, value in (("data", self.data), ("records", self.records), ("budget", self.budget))
                 if value]
        given += ["actors"] if self.actors != 1 else []
        if given:
            raise InvalidValue(f"owner {self.name}: an owner reached by its gateway is named by name and gateway only, "
                             f"not {', '.join(given)} (its own file, on its machine, says them)")
        host, _, port = self.gateway.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidValue(f"owner {self.name}: gateway must be host:port, got {self.gateway!r}")


@dataclass(frozen=True)
class GatewaysConfig:
    """How the coordinator reaches owners' gateways (``gateways``): its certificate and key, issued
    by the consortium's CA, and that CA's certificate (PEM paths; relative ones are the launching
    directory's). ``lifetime_epsilon``: a lifetime ε the run asks every owner to stay within, below
    its own policy's (None: the policies')."""

    certificate: str
    key: str
    ca: str
    lifetime_epsilon: float | None = None

    def __post_init__(self) -> None:
        if self.lifetime_epsilon is not None and not self.lifetime_epsilon > 0:
            raise InvalidValue(f"gateways.lifetime_epsilon must be > 0 or null, got {self.lifetime_epsilon}")


def check_gateways(owners: Sequence[DataOwner], gateways: GatewaysConfig | None) -> None:
    """Owners are all reached by their gateways (with ``gateways`` given) or none."""
    reached = [owner.name for owner in owners if owner.gateway is not None]
    if not reached:
        if gateways is not None:
            raise InvalidValue("gateways: the coordinator's certificates go with owners named by their gateway")
        return
    if len(reached) != len(owners):
        raise InvalidValue(f"owners {reached} are named by their gateway and the others by their data: name every "
                         "owner one way")
    if gateways is None:
        raise InvalidValue("owners named by their gateway need gateways: {certificate, key, ca} (the coordinator's "
                         "certificates, from the consortium's CA)")


def check_owners(owners: Sequence[DataOwner], test: DataSource | None, classes: tuple[str, ...] | None,
                 public: DataSource | None, needs_public: bool = True) -> None:
    """What an owners config needs: distinct names, a labelled test set, and (where the
    pipeline learns from one) a public pool."""
    if test is None or (needs_public and public is None):
        needed = "a public pool and a test set: give public and test sources" if needs_public else \
            "a labelled test set: give a test source"
        raise InvalidValue(f"owners need {needed}")
    if test.label is None and not test.labelled_by_layout:
        raise InvalidValue("test: name its label (column, key or file): the models are evaluated on it")
    names = [owner.name for owner in owners]
    if len(set(names)) != len(names):
        raise InvalidValue(f"owner names must be distinct, got {names}")
    if classes is not None and len(set(classes)) != len(classes):
        raise InvalidValue(f"classes must be distinct, got {list(classes)}")


def check_behind_gateways(owners: Sequence[DataOwner]) -> None:
    """Owners named by their data vote or train behind gateways the run starts on this machine
    (``cluster.gateway.local``): each declares its ``records``, which size its share of every secure
    sum (and DP-SGD's sampling rate and steps, which are released with the model)."""
    for owner in owners:
        if owner.gateway is None and owner.records is None:
            raise InvalidValue(f"owner {owner.name}: declare its records (a public upper bound, never checked against "
                             "its data): its gateway sizes its share of every secure sum by them")


def owner_data(owner: DataOwner, reading: PublicReading, base: str) -> DataSource:
    """What ``owner``'s actors read: its source with relative paths taken from ``base``, read as
    the public data says (``PublicReading``: a table by the pool's columns, its unusable cells
    filled with the pool's means; an image folder at the pool's size). No file is touched: the
    driver never opens an owner's path. An explicit ``columns`` or ``size`` other than the public
    ones is a ``ValueError``, as is an owner named by its gateway (its data are on its machine)."""
    if owner.data is None:
        raise InvalidValue(f"owner {owner.name} is named by its gateway: its data are declared on its own machine, in "
                         "its own file, not in this config")
    try:
        return owner.data.anchored(base).read_as(reading)
    except ValueError as err:
        raise InvalidValue(f"owner {owner.name}: {err}") from None


def check_owner_columns(owners: Sequence[DataOwner], reading: PublicReading) -> None:
    """Owners' explicit ``columns`` (and image ``size``) must be the public schema's: a one-line
    ``ConfigError`` from the driver before Ray starts (the config alone: no owner's file is opened)."""
    from conclave.cluster.config import ConfigError

    for owner in owners:
        if owner.gateway is not None:  # its gateway reads its file as the pool says (``PublicReading``)
            continue
        try:
            owner_data(owner, reading, os.curdir)
        except ValueError as err:
            raise ConfigError(str(err)) from None


@dataclass(frozen=True, eq=False)
class PublicData:
    """What the driver holds: the public pool and the test split (public data only), the
    class list, the input schema (for tables with the pool's column names), and for tables
    the public column statistics."""

    splits: StudentSplits
    classes: tuple[str, ...]
    schema: InputSchema
    standardiser: Standardiser | None

    @classmethod
    def of(cls, splits: StudentSplits, classes: tuple[str, ...], columns: tuple[str, ...] | None = None) -> PublicData:
        schema = InputSchema.of(splits.public, columns)
        standardiser = Standardiser.of_public(splits.public) if schema.kind == "table" else None
        return cls(splits, classes, schema, standardiser)

    @property
    def reading(self) -> PublicReading:
        """How every owner's data is read in this run: by the pool's columns, with the pool's
        column means in an unusable cell, or at the pool's image size (public figures only)."""
        fill = None if self.standardiser is None else tuple(self.standardiser.mean.tolist())
        return PublicReading(self.schema.columns, self.schema.image_size, fill)

    @classmethod
    def read(cls, public: DataSource, test: DataSource, classes: tuple[str, ...] | None) -> PublicData:
        """The ``public`` and ``test`` sources, the test table read by the pool's column names, a
        missing cell of either given the pool's column mean (as an owner's is, ``reading``); the
        class list is ``classes`` or the test labels' (never an owner's)."""
        from conclave.learning.data.sources import MissingColumns, class_names

        columns = input_columns(public)  # the run's inputs, by name (None: not a table)
        try:
            test = test.by_name(columns)
        except ValueError as err:
            raise InvalidValue(f"test: {err}") from None
        if columns is not None:  # public values only: the pool's own means over its finite cells
            means = column_means(public.by_name(columns))
            public, test = (dataclasses.replace(source, fill=means) for source in (public, test))
        try:
            if not classes:
                labels = test.read_raw().labels
                if labels is None:
                    raise InvalidValue(f"test: {test.describes} has no labels: the models are evaluated on them")
                classes = class_names(labels)
            splits = StudentSplits(public=public.read(classes, "public"), test=test.read(classes, "test"))
        except MissingColumns as err:
            pooled = [c for c in err.missing if c in (columns or ())]
            if not pooled:  # the test table's own label
                raise
            # the pool's header sets the run's inputs: an extra column there is missed in test.csv
            raise MissingColumns(f"{public.path}: the public pool's input column(s) {pooled} are not in the test "
                                 f"table {test.path} (every table is read by the pool's columns): drop them from "
                                 "the pool, or add them to the test table", pooled) from None
        if splits.public.input_shape != splits.test.input_shape:
            raise InvalidValue(f"public inputs {list(splits.public.input_shape)} and test inputs "
                             f"{list(splits.test.input_shape)} differ in shape")
        return cls.of(splits, classes, columns)
