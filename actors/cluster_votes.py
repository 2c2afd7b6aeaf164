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

from conclave.actors.knn_votes import padded
from conclave.actors.owners import GroupInfo, OwnerDataError, describe_all, nodes_of
from conclave.actors.placement import require_node
from conclave.actors.vote_parties import RecordShare, VoteParties, VoteParty, party_blocks
from conclave.learning.embeddings import Embedding
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.cluster_histogram import cluster_histogram
from conclave.privacy.mechanisms.public_clusters import CLUSTER_LEMMA

log = logging.getLogger(__name__)


class ClusterShard(VoteParty):
    """The records of shards ``first``..``last - 1`` of one owner's source, embedded and held in
    this process; counts its records' votes for their ``votes_per_record`` nearest queries.

    No Ray here (the actor is the same class). A source that cannot be read is kept as an error
    that ``describe`` raises as ``OwnerDataError`` (one line naming the owner), as for teachers.
    """

    def __init__(self, source, first: int, last: int, embed: Embedding, votes_per_record: int,
                 rows: int | None = None) -> None:
        self.owner, self.votes_per_record = source.owner, votes_per_record
        self.load_error: str | None = None
        try:
            shards = source.load(range(first, last))
        except (OSError, ValueError) as err:  # the owner's file: a missing path, a bad format
            self.load_error = f"owner {self.owner}: {err}".splitlines()[0]
            self.num_classes, self.input_shape = 0, ()
            return
        self.num_classes, self.input_shape = shards[0].num_classes, shards[0].input_shape
        # padded to the declared size (``actors.knn_votes.padded``): a vote takes the same time below it
        self._points, self._labels = padded(np.asarray(embed(np.concatenate([part.x for part in shards])),
                                                       dtype=np.float64),
                                            np.concatenate([part.y for part in shards]), rows)
        self._norms = np.einsum("ij,ij->i", self._points, self._points)

    def describe(self) -> GroupInfo:
        """Classes, input shape and node, nothing about the records; raises if they could not be read."""
        if self.load_error is not None:
            raise OwnerDataError(self.load_error)
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        return GroupInfo(self.num_classes, self.input_shape, node)

    @ray.method(concurrency_group="probe")
    def is_loaded(self) -> bool:
        """Whether this actor holds its records (its own thread in the actor: the health probe)."""
        return self.load_error is None

    def partial_votes(self, queries: np.ndarray, stream: str) -> np.ndarray:
        """``int64[batch, classes]``: this party's records' votes for their nearest queries (nothing
        random: ``stream`` is unused)."""
        if self.load_error is not None:
            raise OwnerDataError(self.load_error)
        return cluster_histogram(self._points, self._labels, queries, self.votes_per_record, self.num_classes,
                                 self._norms)


# Restarted like a kNN shard (its constructor reloads the owner's records); a call is not retried.
ClusterShardActor = ray.remote(max_restarts=3, max_task_retries=0, concurrency_groups={"probe": 1})(ClusterShard)


class ClusterVoteSource(VoteParties):
    """Driver-side handle over the owners' ``ClusterShard`` actors: a vote source for the aggregator.
    It holds actor handles only; each actor reads and embeds its owner's records on the owner's node.

    Args:
        shares: each owner's source, actor count, placement and declared records (the ring's bound).
        embed: the fixed public embedding, applied to queries here and to records in the actors.
        votes_per_record: m, the queries each record votes for.
        num_cpus_per_actor: CPUs each actor reserves.
    """

    neighbouring, neighbouring_lemma = Neighbouring.ADD_REMOVE, CLUSTER_LEMMA
    actor_kind, restart_note = "cluster-vote actor", " (it reloads its owner's records)"

    def __init__(self, shares: Sequence[RecordShare], embed: Embedding, votes_per_record: int,
                 num_cpus_per_actor: float = 1.0) -> None:
        if not shares:
            raise ValueError("public-cluster votes need at least one owner")
        if votes_per_record < 1:
            raise ValueError(f"votes_per_record must be >= 1, got {votes_per_record}")
        self.embed, self.votes_per_record = embed, votes_per_record
        plans = []
        for share in shares:  # every placement checked before any actor starts
            options = share.placement.actor_options(min(share.num_actors, share.source.num_teachers))
            require_node(f"owner {share.source.owner}'s cluster-vote shards", num_cpus_per_actor, 0.0,
                         options.get("resources"), options.get("label_selector"))
            plans.append((share, party_blocks(share.source.num_teachers, share.num_actors), options))
        spawns, owners, self._bounds = [], [], []
        for share, blocks, options in plans:
            for a, b in blocks:
                spawns.append(functools.partial(ClusterShardActor.options(num_cpus=num_cpus_per_actor, **options).remote,
                                                share.source, a, b, embed, votes_per_record))
                owners.append(share.source.owner)
                # A cell counts at most this party's records: its share of what its owner declares.
                declared = share.declared or 1
                self._bounds.append(max(1, -(-declared * (b - a) // share.source.num_teachers)))
        self._track(spawns, owners, num_cpus_per_actor)
        described = describe_all(self._actors, self._owners, self.shutdown)
        self.num_classes, self.input_shape = described[0].num_classes, described[0].input_shape
        self.placement = nodes_of(self._owners, described)
        log.info("public-cluster votes over %d owner(s) on %d actors (each record votes for %d queries)", len(shares),
                 len(self._actors), votes_per_record)

    def queries(self, inputs: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.embed(inputs), dtype=np.float64).reshape(len(inputs), -1)

    def cell_bounds(self) -> list[int]:
        return list(self._bounds)

    def _probe(self, actor: ray.actor.ActorHandle) -> ray.ObjectRef:
        return actor.is_loaded.remote()

    def shutdown(self) -> None:
        """Stop the actors (the records and embeddings they hold go with them)."""
        self.stop()
