"""An owner's data, read only by its actors behind its gateway, and what those actors may say about it.

Teacher groups and the actors whose records vote load an owner's source in their own process
(``OwnerSource.load``) and answer ``describe`` with a ``GroupInfo``: the class count, the input
shape and the node they run on — nothing about the records. A source that cannot be read
there (no such file or column, not the declared format: the schema, not a record) comes back
to the gateway as one ``OwnerDataError`` line naming the owner.

Nothing else about the records may change the run's course: unusable rows (a missing or
non-numeric value, a label outside the run's classes) are dropped here, an owner holding fewer
records than it declared runs with what it has, and one holding more has its teachers' shards cut
down where they are read (``learning.data.dataset.cap_shard``). The coordinator is told none of it;
the owner sees it with ``conclave check-data``.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import ray

from conclave.actors.placement import PlacementError
from conclave.errors import ConclaveError, InvalidValue
from conclave.learning.data import Dataset, shard
from conclave.learning.data.dataset import cap_shard, shard_cap
from conclave.learning.data.sources import DataSource


@dataclass(frozen=True)
class OwnerSource:
    """One owner's own data, read only where its actors run, cut into ``num_teachers`` shards.

    ``data`` is a path on the owner's node in one of ``learning.data.sources.FORMATS``; a table
    is read by the public schema's column names, which the driver puts in ``data.columns``
    (``cluster.owners.owner_data``: public config, read from the public pool's header); its
    labels are mapped onto ``classes`` (the run's class list, from the config or the public
    test data). ``seed`` keys the shard hash, as for ``TeacherSource``. ``num_teachers`` is the
    number of shards: teachers, or the actors whose records vote.

    ``records``: the owner's declared upper bound, for teachers. Each shard keeps at most
    ``shard_cap(records, num_teachers)`` records, a uniformly random subset drawn from OS entropy
    when it holds more; fewer is no error. Records that vote themselves leave it None: cutting a
    shard down would turn adding a record into replacing one.
    """

    owner: str
    data: DataSource
    num_teachers: int
    classes: tuple[str, ...]
    seed: int = 0
    features: str | None = None
    records: int | None = None

    def __post_init__(self) -> None:
        if self.num_teachers < 1:
            raise InvalidValue(f"owner {self.owner}: teachers must be >= 1, got {self.num_teachers}")

    def load(self, teacher_ids: Sequence[int]) -> list[Dataset]:
        dataset, _ = self.data.read_private(self.classes, name=self.owner)  # what was dropped stays here
        if dataset.unlabeled:  # the source has no labels at all: its schema, not a record
            fix = "put its images in one folder per class" if self.data.format == "images" else \
                "name its label (column, key or file)"
            raise InvalidValue(f"{self.data.describes} has no labels: {fix}")
        shards = [shard(dataset, self.num_teachers, self.seed)[i] for i in teacher_ids]
        if self.records is None:
            return shards
        cap = shard_cap(self.records, self.num_teachers)
        rng = np.random.default_rng(secrets.randbits(128))
        return [cap_shard(part, cap, rng) for part in shards]


class OwnerDataError(ConclaveError, RuntimeError):
    """An owner's data could not be read where its actors run (one line naming the owner)."""

    exit_code = 2


class OwnerDropout(ConclaveError, RuntimeError):
    """An owner's actor died in the middle of a secure sum: the round cannot complete, so the run
    stops and releases nothing of it (one line naming the owner)."""

    exit_code = 3


@dataclass(frozen=True)
class GroupInfo:
    """What an actor holding an owner's data says about itself: the shape of its inputs and
    where it runs — nothing about its data."""

    num_classes: int
    input_shape: tuple[int, ...]
    node_id: str


def describe_all(actors: Sequence, owners: Sequence[str], on_failure: Callable[[], None],
                 timeout_s: float | None = None) -> list[GroupInfo]:
    """Every actor's ``describe()``, once each has loaded its data. A source that could not be
    read, or owners whose data disagree in shape or classes, call ``on_failure`` (to free
    the actors that did start) and raise ``OwnerDataError`` in one line; actors not all
    started within ``timeout_s`` (None: wait) raise ``PlacementError``."""
    try:
        described: list[GroupInfo] = ray.get([actor.describe.remote() for actor in actors], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        on_failure()
        raise PlacementError(f"the actors of {', '.join(sorted(set(owners)))} did not all start within "
                             f"{timeout_s:g} s: the cluster has no room for all of them at once") from None
    except ray.exceptions.RayTaskError as err:
        on_failure()
        if isinstance(err.cause, OwnerDataError):
            raise OwnerDataError(str(err.cause)) from None
        raise
    except Exception:
        on_failure()
        raise
    if len({(info.num_classes, info.input_shape) for info in described}) > 1:
        on_failure()
        found = ", ".join(f"owner {o}: {i.num_classes} classes, inputs {list(i.input_shape)}"
                          for o, i in zip(owners, described))
        raise OwnerDataError(f"owners' data do not share one input shape and class list ({found})")
    return described


def nodes_of(owners: Sequence[str], described: Sequence[GroupInfo]) -> dict[str, list[str]]:
    """Owner → the Ray node ids its actors run on (for the results: where the data stayed)."""
    nodes: dict[str, list[str]] = {}
    for owner, info in zip(owners, described):
        if info.node_id not in nodes.setdefault(owner, []):
            nodes[owner].append(info.node_id)
    return nodes
