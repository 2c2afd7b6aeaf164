"""Public-cluster votes over owners' records (reverse kNN, ``privacy.mechanisms.public_clusters``):
every record votes, with its label, for its m nearest queries of the batch.

Each ``ClusterShard`` actor holds one block of one owner's records, embedded on the owner's node
in the run's fixed public embedding, and counts its partial histogram ``int64[batch, classes]``:
for each of its records, +1 at (each of its m nearest queries, its label). Exactly min(m, B)
distinct queries per record, ties by query order (``privacy.cluster_histogram``): adding or removing a
record moves m cells of the batch's histograms by one (``CLUSTER_LEMMA``), whatever the other
records — the whole batch is one release.

Across owners only masked shares leave (secure rounds, ``actors.vote_parties``); the clean sum of
partials is for one owner whose node runs the aggregator, as for the other vote sources.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import numpy as np
import ray

from conclave.actors.owner_records import EmbeddedRecords
from conclave.actors.owners import OwnerSource, describe_all, nodes_of
from conclave.actors.teacher import TeacherSource
from conclave.actors.vote_parties import RecordShare, VoteParties, plan_parties
from conclave.errors import InvalidValue
from conclave.learning.embeddings import Embedding
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.cluster_histogram import cluster_histogram
from conclave.privacy.mechanisms.public_clusters import CLUSTER_LEMMA

log = logging.getLogger(__name__)


class ClusterShard(EmbeddedRecords):
    """The records of shards ``first``..``last - 1`` of one owner's source, embedded and held in
    this process (``EmbeddedRecords``); counts its records' votes for their ``votes_per_record``
    nearest queries."""

    def __init__(self, source: TeacherSource | OwnerSource, first: int, last: int, embed: Embedding,
                 votes_per_record: int, rows: int | None = None) -> None:
        super().__init__(source, first, last, embed, rows)
        self.votes_per_record = votes_per_record

    def partial_votes(self, queries: np.ndarray, stream: str) -> np.ndarray:
        """``int64[batch, classes]``: this party's records' votes for their nearest queries (nothing
        random: ``stream`` is unused)."""
        self._require_loaded()
        return cluster_histogram(self._points, self._labels, queries, self.votes_per_record, self.num_classes,
                                 self._norms)


# Restarted like a kNN shard (its constructor reloads the owner's records); a call is not retried.
ClusterShardActor = ray.remote(max_restarts=3, max_task_retries=0, concurrency_groups={"probe": 1})(ClusterShard)


class ClusterVoteSource(VoteParties):
    """Driver-side handle over the owners' ``ClusterShard`` actors: a vote source for the aggregator.
    It holds actor handles only; each actor reads and embeds its owner's records on the owner's node.

    Args:
        shares: each owner's source, actor count and declared records (the ring's bound).
        embed: the fixed public embedding, applied to queries here and to records in the actors.
        votes_per_record: m, the queries each record votes for.
        num_cpus_per_actor: CPUs each actor reserves.
    """

    neighbouring, neighbouring_lemma = Neighbouring.ADD_REMOVE, CLUSTER_LEMMA
    actor_kind, restart_note = "cluster-vote actor", " (it reloads its owner's records)"
    # Each record votes for its m nearest queries OF THE BATCH: a query's votes depend on the
    # batch's other queries, and only the batch's total is fixed (records × m), not a query's.
    votes_per_query, batch_coupled = None, True

    def __init__(self, shares: Sequence[RecordShare], embed: Embedding, votes_per_record: int,
                 num_cpus_per_actor: float = 1.0) -> None:
        if not shares:
            raise InvalidValue("public-cluster votes need at least one owner")
        if votes_per_record < 1:
            raise InvalidValue(f"votes_per_record must be >= 1, got {votes_per_record}")
        self.embed, self.votes_per_record = embed, votes_per_record
        spawns, owners, self._bounds = [], [], []
        for plan in plan_parties(shares, num_cpus_per_actor, "cluster-vote shards"):
            share = plan.share
            for a, b in plan.blocks:
                rows = share.declared_rows(a, b)  # padded to it: a vote's time says nothing of the records
                actor = ClusterShardActor.options(num_cpus=num_cpus_per_actor)
                spawns.append(functools.partial(actor.remote, share.source, a, b, embed, votes_per_record, rows=rows))
                owners.append(share.source.owner)
                self._bounds.append(rows or 1)  # a cell counts at most this party's declared records
        self._track(spawns, owners, num_cpus_per_actor)
        described = describe_all(self.roster.actors, self.roster.owners, self.shutdown)
        self.num_classes, self.input_shape = described[0].num_classes, described[0].input_shape
        self.placement = nodes_of(self.roster.owners, described)
        log.info("public-cluster votes over %d owner(s) on %d actors (each record votes for %d queries)", len(shares),
                 len(self.roster.actors), votes_per_record)

    def queries(self, inputs: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.embed(inputs), dtype=np.float64).reshape(len(inputs), -1)

    def cell_bounds(self) -> list[int]:
        return list(self._bounds)

    def _probe(self, actor: ray.actor.ActorHandle) -> ray.ObjectRef:
        return actor.is_loaded.remote()

    def shutdown(self) -> None:
        """Stop the actors (the records and embeddings they hold go with them)."""
        self.stop()
