"""An owner's records, read and embedded on its node: what every vote source in which the records
vote themselves (kNN votes, public-cluster votes) holds in its actors.

The records are read where the actor runs (``OwnerSource.load``, the owner's node), embedded there
in the run's fixed public embedding one record at a time (``Embedding.records``: each vector a
function of its record alone, bit for bit), kept as float64 with their squared norms (which only
prune: exact per-record distances choose, ``privacy.exact_distances``), and padded to the owner's declared size so
that the work per query says nothing of how many records there are. Nothing here leaves the actor;
each subclass says what it counts from them (``VoteParty.partial_votes``).

No Ray here (the actor is the subclass itself); ``is_loaded`` runs in the actor's "probe"
concurrency group, so the aggregator's health probe is answered while a long vote is under way.
"""
from __future__ import annotations

import numpy as np
import ray

from conclave.actors.owners import GroupInfo, OwnerDataError, OwnerSource
from conclave.actors.teacher import TeacherSource
from conclave.actors.vote_parties import VoteParty
from conclave.learning.embeddings import Embedding


def padded(points: np.ndarray, labels: np.ndarray, rows: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The records, padded with rows of label -1 up to ``rows`` (a party's share of what its owner
    declares), so that the work per query — distances, draws, the candidates' sort — is that of the
    declared size whatever the owner holds below it: how long a vote takes says nothing of the
    records (docs/privacy.md, "Timing"). Padding rows never vote."""
    if rows is None or rows <= len(labels):
        return points, labels
    extra = rows - len(labels)
    return (np.concatenate([points, np.zeros((extra, points.shape[1]))]),
            np.concatenate([labels, np.full(extra, -1, dtype=labels.dtype)]))


class EmbeddedRecords(VoteParty):
    """Shards ``first``..``last - 1`` of ``source`` (one owner's), embedded by ``embed`` and padded to
    ``rows``. A source that cannot be read is kept as an error that ``describe`` (and any vote)
    raises as ``OwnerDataError``: one line naming the owner, as for teachers."""

    def __init__(self, source: TeacherSource | OwnerSource, first: int, last: int, embed: Embedding,
                 rows: int | None = None) -> None:
        self.owner = source.owner
        self.load_error: str | None = None
        try:
            shards = source.load(range(first, last))
        except (OSError, ValueError) as err:  # the owner's file: a missing path, a bad format
            self.load_error = f"owner {self.owner}: {err}".splitlines()[0]
            self.num_classes, self.input_shape = 0, ()
            return
        self.num_classes, self.input_shape = shards[0].num_classes, shards[0].input_shape
        self._points, self._labels = padded(np.asarray(embed.records(np.concatenate([part.x for part in shards])),
                                                       dtype=np.float64),
                                            np.concatenate([part.y for part in shards]), rows)
        self._norms = np.einsum("ij,ij->i", self._points, self._points)

    def describe(self) -> GroupInfo:
        """Classes, input shape and node, nothing about the records; raises if they could not be read."""
        self._require_loaded()
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        return GroupInfo(self.num_classes, self.input_shape, node)

    @ray.method(concurrency_group="probe")
    def is_loaded(self) -> bool:
        """Whether this actor holds its records and can answer (the aggregator's health probe)."""
        return self.load_error is None

    def _require_loaded(self) -> None:
        if self.load_error is not None:
            raise OwnerDataError(self.load_error)
