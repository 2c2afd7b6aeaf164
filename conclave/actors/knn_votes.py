"""kNN votes over owners' records: every private record votes through its nearest neighbours.

Private-kNN (Zhu, Yu, Chandraker & Wang, CVPR 2020): a fresh Poisson sample of the records per
query, whose k nearest in a fixed public embedding vote with their labels (``KNN_LEMMA``).
Records stay in ``KnnShard`` actors on their owner's node. Across owners each actor sends only a
masked share of its partial histogram; the clean merge of distances, which locate records, is
for one owner whose node runs the aggregator. docs/privacy.md, "Who sees what".
"""
from __future__ import annotations

import logging
import functools
import math
from typing import Sequence

import numpy as np
import ray

from conclave.actors.owner_records import EmbeddedRecords
from conclave.actors.owners import OwnerSource, describe_all, nodes_of
from conclave.actors.teacher import TeacherSource
from conclave.actors.vote_parties import INLINE_INPUT_BYTES, RecordShare, VoteParties, declared_share, plan_parties
from conclave.errors import InvalidValue
from conclave.learning.embeddings import Embedding
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.exact_distances import nearest_records
from conclave.privacy.mechanisms.private_knn import KNN_LEMMA
from conclave.privacy.noise import SECURE, NoisePolicy

log = logging.getLogger(__name__)

# Distances of at most this many (query, record) pairs at once: a chunk's inclusion draws and
# distances stay near 64 MiB whatever the batch and the owner's size.
CHUNK_PAIRS = 4_000_000


def sample_stream(round_: int, shard: int) -> str:
    """The noise stream of shard actor ``shard``'s inclusion draws in vote round ``round_`` (from 1):
    distinct per round and actor, so an insecure seed replays each sample and no two coincide."""
    return f"knn-votes/{round_}/{shard}"


class KnnShard(EmbeddedRecords):
    """The records of shards ``first``..``last - 1`` of one owner's source, embedded and held in
    this process (``EmbeddedRecords``); answers each query with its k nearest records of a fresh
    Poisson sample — as distances and labels for the clean merge (``neighbours``), or counted here
    into this party's own histogram (``partial_votes``: its k nearest, the owner-local vote a
    secure round sums)."""

    def __init__(self, source: TeacherSource | OwnerSource, first: int, last: int, embed: Embedding,
                 k: int, sample_rate: float, index: int, noise: NoisePolicy = SECURE, rows: int | None = None) -> None:
        super().__init__(source, first, last, embed, rows)
        self.k, self.sample_rate, self.index, self.noise = k, sample_rate, index, noise

    def neighbours(self, queries: np.ndarray, round_: int) -> tuple[np.ndarray, np.ndarray]:
        """For embedded ``queries`` ``[batch, d]``: squared distances ``float64[batch, k]`` and labels
        ``int64[batch, k]`` of each query's k nearest records among those included (each with
        probability ``sample_rate``, drawn here from stream ``sample_stream(round_, index)``),
        nearest first, ties by record position; +inf / -1 where fewer than k are included."""
        return self._sampled_nearest(queries, sample_stream(round_, self.index))

    def partial_votes(self, queries: np.ndarray, stream: str) -> np.ndarray:
        """``int64[batch, classes]``: the labels of each query's k nearest records of a fresh Poisson
        sample (drawn from ``stream``), counted here; nothing per record leaves."""
        _, labels = self._sampled_nearest(queries, stream)
        batch = len(labels)
        cells = (np.arange(batch)[:, None] * self.num_classes + labels)[labels >= 0]  # pads vote for nothing
        return np.bincount(cells, minlength=batch * self.num_classes).reshape(batch, self.num_classes)

    def _sampled_nearest(self, queries: np.ndarray, stream: str) -> tuple[np.ndarray, np.ndarray]:
        self._require_loaded()
        queries = np.asarray(queries, dtype=np.float64)
        batch, n = len(queries), len(self._labels)
        distances = np.full((batch, self.k), np.inf)
        labels = np.full((batch, self.k), -1, dtype=np.int64)
        rng = self.noise.source(stream).rng
        voters = self._labels >= 0  # padding rows: sampled like records, never anyone's neighbour
        rows = max(1, CHUNK_PAIRS // max(n, 1))
        for start in range(0, batch, rows):
            chunk = queries[start:start + rows]
            # Consecutive draws from one generator equal one [batch, n] draw: chunking keeps the sample.
            included = (rng.random((len(chunk), n)) < self.sample_rate) & voters
            # The matrix product only prunes; exact per-record distances choose (privacy.exact_distances).
            approximate = self._norms[None, :] - 2.0 * (chunk @ self._points.T) + np.einsum("ij,ij->i", chunk, chunk)[:, None]
            for row in range(len(chunk)):
                nearest, exact = nearest_records(self._points, self._norms, chunk[row], approximate[row],
                                                 np.flatnonzero(included[row]), self.k)
                distances[start + row, :len(nearest)] = exact
                labels[start + row, :len(nearest)] = self._labels[nearest]
        return distances, labels


# Restarted like a teacher group (its constructor reloads the owner's records); a call is not
# retried, so a vote fails at once rather than waiting. Only the health probe has a thread of its own.
KnnShardActor = ray.remote(max_restarts=3, max_task_retries=0, concurrency_groups={"probe": 1})(KnnShard)


class KnnVoteSource(VoteParties):
    """Driver-side handle over the owners' ``KnnShard`` actors: a vote source for the aggregator
    (``actors.labeller.VoteSource``). It holds the actor handles only — never records or their
    embeddings: each actor loads its owner's records on the owner's node.

    Two ways to count, fixed at construction (``local``):
    - **owner-local** (``local=True``, the only one across owners): each party votes with its own
      k_p nearest sampled records, k_p fixed in advance from the declared record counts (``party_k``),
      and the partial histograms meet only in a secure round (``noised_votes``). One record moves
      one party's histogram by at most one vote (the kNN lemma, per party).
    - **clean merge** (``local=False``, one owner whose node runs the aggregator): ``votes`` merges
      the global k nearest by (distance, actor, rank in the actor's answer) from every actor's
      distances and labels, and counts their labels. The distances say more than the votes (the
      chosen-query attack of issue 37 rebuilds records from them), so this stays inside one owner.

    Health as for teachers (``VoteParties``): ``ready`` is False while an actor restarts or is
    hung, and an actor that died past Ray's restarts is started again (it reloads its owner's
    records, under the same index: its sampling streams stay its own).

    Args:
        shares: each owner's source, actor count and declared records (for ``local``).
        embed: the fixed public embedding, applied to queries here and to records in the actors.
        k: neighbours per query (≥ 1), shared among the parties when ``local``.
        sample_rate: each record's inclusion probability per query, in (0, 1].
        noise: where the inclusion draws come from (OS entropy unless a test asks to replay them).
        num_cpus_per_actor: CPUs each actor reserves.
        local: owner-local votes (secure rounds) rather than the clean merge.
    """

    neighbouring, neighbouring_lemma = Neighbouring.ADD_REMOVE, KNN_LEMMA
    actor_kind, restart_note = "kNN actor", " (it reloads its owner's records)"
    # Up to k votes per query, fewer where the sample holds fewer records; each query's its own.
    votes_per_query, batch_coupled = None, False

    def __init__(self, shares: Sequence[RecordShare], embed: Embedding, k: int, sample_rate: float,
                 noise: NoisePolicy = SECURE, num_cpus_per_actor: float = 1.0, local: bool = False) -> None:
        if not shares:
            raise InvalidValue("kNN votes need at least one owner")
        if k < 1:
            raise InvalidValue(f"k must be >= 1, got {k}")
        if not 0.0 < sample_rate <= 1.0 or not math.isfinite(sample_rate):
            raise InvalidValue(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        self.embed, self.k, self.sample_rate, self.local = embed, k, sample_rate, local
        plans = plan_parties(shares, num_cpus_per_actor, "kNN shards")
        self.party_k = party_k([(plan.share, plan.blocks) for plan in plans], k) if local else None
        spawns, owners = [], []
        for plan in plans:
            share = plan.share
            for a, b in plan.blocks:
                k_here = self.party_k[len(spawns)] if local else k
                actor = KnnShardActor.options(num_cpus=num_cpus_per_actor)
                spawns.append(functools.partial(actor.remote, share.source, a, b, embed, k_here, sample_rate,
                                                len(spawns), noise, rows=share.declared_rows(a, b)))
                owners.append(share.source.owner)
        self._track(spawns, owners, num_cpus_per_actor)
        described = describe_all(self.roster.actors, self.roster.owners, self.shutdown)
        self.num_classes, self.input_shape = described[0].num_classes, described[0].input_shape
        self.placement = nodes_of(self.roster.owners, described)
        log.info("kNN votes over %d owner(s) on %d actors (k=%d%s, sample rate %g)", len(shares),
                 len(self.roster.actors), k, f" shared as {self.party_k}" if local else "", sample_rate)

    def queries(self, inputs: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.embed(inputs), dtype=np.float64).reshape(len(inputs), -1)

    def cell_bounds(self) -> list[int]:
        return list(self.party_k or [self.k] * len(self.roster.actors))

    def neighbours(self, inputs: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each actor's answer for one round: squared distances ``float64[batch, k]`` and labels
        ``int64[batch, k]`` of its k nearest sampled records per query (what the merge sees)."""
        if self.local:
            raise RuntimeError("owner-local kNN votes never send distances: their rounds are secure")
        queries = self.queries(self.checked(inputs))
        shared = ray.put(queries) if queries.nbytes > INLINE_INPUT_BYTES else queries
        self._rounds += 1
        calls = [actor.neighbours.remote(shared, self._rounds) for actor in self.roster.actors]
        try:
            return ray.get(calls, timeout=self.vote_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.roster.abandon(calls)
            calls.clear()
            raise TimeoutError(f"the kNN shards gave no neighbours within {self.vote_timeout_s:g} s") from None

    def _probe(self, actor: ray.actor.ActorHandle) -> ray.ObjectRef:
        return actor.is_loaded.remote()

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        """Vote histogram ``int64[batch, num_classes]`` of the global k nearest sampled records."""
        if self.local:
            raise RuntimeError("owner-local kNN votes meet only in secure rounds (noised_votes)")
        answers = self.neighbours(inputs)
        distances = np.concatenate([d for d, _ in answers], axis=1)
        labels = np.concatenate([lab for _, lab in answers], axis=1)
        # Deterministic ties: by distance, then actor, then rank within the actor's answer.
        actor = np.repeat(np.arange(len(answers)), self.k)
        rank = np.tile(np.arange(self.k), len(answers))
        order = np.lexsort((np.broadcast_to(rank, distances.shape), np.broadcast_to(actor, distances.shape),
                            distances), axis=-1)[:, :self.k]
        nearest = np.take_along_axis(labels, order, axis=1)
        batch = len(nearest)
        cells = (np.arange(batch)[:, None] * self.num_classes + nearest)[nearest >= 0]  # pads vote for nothing
        return np.bincount(cells, minlength=batch * self.num_classes).reshape(batch, self.num_classes)

    def shutdown(self) -> None:
        """Stop the actors (the records and embeddings they hold go with them)."""
        self.stop()


def party_k(shares: Sequence[tuple[RecordShare, list[tuple[int, int]]]], k: int) -> list[int]:
    """Each party's k for owner-local votes: k shared among the owners by their declared records
    (equally where none is declared: the benchmark's parts), then among an owner's parties by
    their shards — public figures only, fixed before any record is read."""
    per_owner = declared_share(k, [share.declared or 1 for share, _ in shares])
    return [k_owner_part for (share, blocks), k_owner in zip(shares, per_owner)
            for k_owner_part in declared_share(k_owner, [b - a for a, b in blocks])]
