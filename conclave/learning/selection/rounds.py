"""Which public pool inputs a student asks about next, a round at a time (``QuerySelection``).

A round is chosen from public inputs and the labels released so far only: the pool in order, a
k-means cold start, a strategy over a model trained on the answers (``StudentTrainer``), or one
medoid per cluster of the pool in the vote source's public embedding (``clusters``), whose
answers then label their clusters.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from conclave.errors import InvalidValue
from conclave.learning.data import Dataset
from conclave.learning.embeddings import Embedding
from conclave.learning.selection import CLUSTERS, POOL_ORDER, PublicPool, QuerySelection, build_strategy
from conclave.learning.selection.clusters import PoolClusters, cluster_pool
from conclave.learning.selection.cold_start import kmeans_cold_start
from conclave.learning.training import embed, predict_logits
from conclave.privacy.mechanisms.base import ABSTAIN

if TYPE_CHECKING:
    from conclave.learning.student_training import StudentTrainer


class QueryRounds:
    """The next pool indices to ask, chosen round by round by ``selection``; ``trainer`` fits the
    model a strategy looks at; ``cluster_embedding``: the vote source's public embedding, where
    ``clusters`` selection cuts the pool."""

    def __init__(self, public: Dataset, selection: QuerySelection, trainer: StudentTrainer,
                 cluster_embedding: Embedding | None = None) -> None:
        if selection.strategy == CLUSTERS and cluster_embedding is None:
            raise InvalidValue("clusters selection needs the vote source's public embedding (cluster_embedding)")
        self.public = public
        self.selection = selection
        self.trainer = trainer
        self.cluster_embedding = cluster_embedding
        self.clusters: PoolClusters | None = None  # the last "clusters" round's cut of the pool
        self._round: list[int] = []  # chosen for the current round, not asked yet
        self._rng = np.random.default_rng(selection.seed)

    def next_batch(self, count: int, asked_order: list[int], labels: np.ndarray) -> np.ndarray:
        """The next ``count`` pool indices to ask: from the current round, choosing a new one when
        it is spent (``asked_order``: the indices asked so far; ``labels``: by pool index)."""
        if not self._round:
            self._round = self._choose_round(asked_order, labels).tolist()
        chosen, self._round = self._round[:count], self._round[count:]
        return np.asarray(chosen, dtype=np.int64)

    def put_back(self, indices: np.ndarray) -> None:
        """``indices`` were not asked after all (refused): they are the next asked."""
        self._round = [*indices.tolist(), *self._round]

    def cluster_labels(self, keep: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The pool inputs the answered medoids ``keep`` label, and their labels (``QuerySelection.spread_medoids``)."""
        selection = self.selection
        spread = self.clusters.spread(dict(zip(keep.tolist(), labels.tolist())), selection.spread_medoids,
                                      selection.spread_decay, selection.spread_margin)
        members = np.fromiter(spread, dtype=np.int64, count=len(spread))
        return members, np.fromiter(spread.values(), dtype=np.int64, count=len(spread))

    def _choose_round(self, asked_order: list[int], labels: np.ndarray) -> np.ndarray:
        unasked = np.setdiff1d(np.arange(len(self.public)), np.asarray(asked_order, dtype=np.int64))
        size = min(self.selection.round_size, len(unasked))
        answered = np.asarray([i for i in asked_order if labels[i] != ABSTAIN], dtype=np.int64)
        cold = len(np.unique(labels[answered])) < 2  # nothing to learn from yet
        if self.selection.strategy == CLUSTERS:  # one medoid per cluster of the pool, largest first
            self.clusters = cluster_pool(self.cluster_embedding(self.public.x), size, self.selection.seed)
            return np.asarray([m for m in self.clusters.medoids if m in set(unasked.tolist())], dtype=np.int64)
        if self.selection.strategy == POOL_ORDER:
            if not (cold and self.selection.cold_start == "kmeans"):
                return unasked  # setdiff1d keeps the pool's order
            first = kmeans_cold_start(self.trainer.pool(), unasked, size, self.selection.seed)
            return np.concatenate([first, np.setdiff1d(unasked, first)])  # then the rest in pool order
        if cold:
            if self.selection.cold_start == "kmeans":
                return kmeans_cold_start(self.trainer.pool(), unasked, size, self.selection.seed)
            return self._rng.choice(unasked, size=size, replace=False)
        pool = self.trainer.pool()
        model = self.trainer.fit_fresh(Dataset(pool[answered], labels[answered], self.public.num_classes,
                                               "student/answered", self.trainer.features))
        candidates = PublicPool(predict_logits(model, pool[unasked]), embed(model, pool[unasked]))
        picked = build_strategy(self.selection.strategy).select(candidates, [size], self._rng)[size]
        return unasked[picked]
