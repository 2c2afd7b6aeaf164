"""The student: public inputs in, private labels from the aggregator over gRPC, a model out.

An ordinary gRPC client of the aggregator (through an injected client factory), as an outside
party would be. It asks about the pool inputs its ``QueryRounds`` choose from public inputs and
released labels, no more than the budget pays for, and learns from the answers through its
``StudentTrainer`` (supervised, self-training, FixMatch or label propagation): all
post-processing. The pool's true labels only measure label accuracy.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray
import torch
from tqdm import tqdm

from conclave.errors import InvalidValue
from conclave.learning.data import Dataset
from conclave.learning.embeddings import Embedding, NetworkEmbedding
from conclave.learning.selection import QuerySelection
from conclave.learning.selection.rounds import QueryRounds
from conclave.learning.student_training import StudentTrainer
from conclave.privacy.mechanisms.base import ABSTAIN
from conclave.progress import COUNTS

log = logging.getLogger(__name__)


class Student:
    """Holds the public pool and the answers it has received (plain class; see ``StudentActor``).

    Args:
        public: the unlabeled pool (its ``y`` only measures label accuracy).
        trainer: how it learns from the answers, and the test split it is scored on.
        client_factory: builds a connected aggregator client (``label_reply``, ``budget``,
            ``is_budget_refusal``, ``close``: ``cluster.client.AggregatorClient``).
        num_threads: torch's threads in this process (an actor: the CPUs it reserved).
        selection: which pool inputs to ask about (``QueryRounds``).
        cluster_embedding: the vote source's public embedding, where "clusters" selection cuts the
            pool (public-cluster votes: each answered medoid labels its cluster).
    """

    def __init__(self, public: Dataset, trainer: StudentTrainer, client_factory: Callable[[], Any],
                 num_threads: int | None = None, selection: QuerySelection = QuerySelection(),
                 cluster_embedding: Embedding | None = None) -> None:
        if num_threads is not None:  # in an actor: as many threads as the CPUs it reserved
            torch.set_num_threads(max(1, num_threads))
        self.public = public  # images: what the student asks about
        self.trainer = trainer
        self.rounds = QueryRounds(public, selection, trainer, cluster_embedding)
        self.client_factory = client_factory
        self.labels = np.full(len(public), ABSTAIN, dtype=np.int64)  # by pool index
        self.asked_order: list[int] = []  # pool indices, in the order they were asked
        self.exhausted = False  # the aggregator refused: no budget left
        self.snapshots: list[dict[str, Any]] = []
        self._client: Any = None
        self._last_model: torch.nn.Module | None = None  # the last fit_and_evaluate's (``network``)

    @property
    def asked(self) -> int:
        return len(self.asked_order)

    def query(
        self,
        num_queries: int,
        batch_size: int = 256,
        checkpoints: Sequence[int] = (),
        progress: bool = True,
        max_batches: int | None = None,
    ) -> dict[str, Any]:
        """Ask for labels of ``num_queries`` pool inputs (chosen by ``selection``), at most ``batch_size`` per call.

        After each checkpoint (a number of inputs asked) the aggregator's budget is read and
        kept, so accuracy can later be plotted against ε. No call asks more new inputs than the
        budget pays for (``affordable_queries`` of the last reply, or of a ``GetBudget`` before
        the first call), so at the end of the budget the batches shrink to what it pays and no
        input is refused; it stops, keeping every answer received, when the budget pays for none,
        without a call. Another client may spend the budget meanwhile: then the answers to part
        of a batch are kept and the rest asked again, and a whole batch refused ends it too.
        With ``max_batches`` it returns after that many calls and a later call carries on where
        it stopped (so a driver can show progress while the student runs in an actor).
        """
        if not 1 <= num_queries <= len(self.public):
            raise InvalidValue(f"num_queries must be in [1, {len(self.public)}] (pool size), got {num_queries}")
        if batch_size < 1:
            raise InvalidValue(f"batch_size must be >= 1, got {batch_size}")
        stops = sorted({c for c in checkpoints if 0 < c < num_queries} | {num_queries})
        if self._client is None:
            self._client = self.client_factory()
        calls = 0
        budget: dict[str, Any] | None = None  # read before the first call, then each reply's (the budget after it)
        with tqdm(total=num_queries, initial=self.asked, desc="student queries", unit="queries",
                  bar_format=COUNTS, disable=not progress) as bar:
            for stop in (s for s in stops if s > self._last_snapshot()):
                while self.asked < stop and not self.exhausted and (max_batches is None or calls < max_batches):
                    if budget is None:
                        budget = self._client.budget()
                    affordable = int(budget["affordable_queries"])
                    if affordable == 0:
                        log.warning("privacy budget exhausted at %d queries: it pays for no new input", self.asked)
                        self.exhausted = True
                        break
                    chosen = self.rounds.next_batch(min(batch_size, stop - self.asked, affordable),
                                                    self.asked_order, self.labels)
                    try:
                        reply = self._client.label_reply(self.public.x[chosen])
                    except Exception as err:  # only a budget refusal is an expected end
                        if not self._client.is_budget_refusal(err):
                            raise
                        log.warning("aggregator refused at %d queries: privacy budget exhausted", self.asked)
                        self.exhausted = True
                        self.rounds.put_back(chosen)  # not asked after all
                        break
                    calls += 1
                    budget = reply.budget
                    # Another client spent the budget since it was read and it paid for part of the
                    # batch: keep those answers and ask again for the rest when it pays for them.
                    asked, refused = chosen[~reply.refused], chosen[reply.refused]
                    self.labels[asked] = reply.labels[~reply.refused]
                    self.asked_order.extend(asked.tolist())
                    bar.update(len(asked))
                    self.rounds.put_back(refused)
                    if len(refused):
                        log.info("aggregator paid for %d of %d inputs at %d queries: asking again for the rest",
                                 len(asked), len(chosen), self.asked)
                    if not len(asked):  # nothing paid, nothing on record: the budget is spent
                        log.warning("aggregator refused at %d queries: privacy budget exhausted", self.asked)
                        self.exhausted = True
                if self.asked == stop or self.exhausted:
                    self.snapshots.append(self._snapshot(self._client.budget()))
                if self.asked < stop:
                    break
        return self.summary()

    # ---- what the answers gave ----

    def _last_snapshot(self) -> int:
        return self.snapshots[-1]["asked"] if self.snapshots else 0

    def _snapshot(self, budget: dict[str, Any]) -> dict[str, Any]:
        return {"asked": self.asked, "answered": len(self._answered(self.asked)), "budget": dict(budget)}

    def _answered(self, asked: int) -> np.ndarray:
        """Pool indices answered with a label among the first ``asked`` asked."""
        first = np.asarray(self.asked_order[:asked], dtype=np.int64)
        return first[self.labels[first] != ABSTAIN]

    def summary(self) -> dict[str, Any]:
        """What the queries so far gave: counts, label accuracy and the checkpoints. No time: how
        long the aggregator took to answer grows with the voters' private records (kNN votes)."""
        return {
            "asked": self.asked,
            "answered": len(self._answered(self.asked)),
            "budget_exhausted": self.exhausted,
            "label_accuracy": self.label_accuracy(),
            "checkpoints": list(self.snapshots),
        }

    def close(self) -> None:
        """Close the connection to the aggregator."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def label_accuracy(self) -> float:
        """Fraction of released labels that match the pool's ground truth (nan if none, or if
        the pool has no labels)."""
        answered = self._answered(self.asked)
        if not len(answered) or self.public.unlabeled:
            return math.nan
        return float((self.labels[answered] == self.public.y[answered]).mean())

    def fit_and_evaluate(self, asked: int | None = None, progress: bool = False) -> dict[str, Any]:
        """Train a fresh model on the answers among the first ``asked`` queries; test accuracy."""
        asked = self.asked if asked is None else min(asked, self.asked)
        keep = self._answered(asked)
        labels = self.labels[keep]
        result: dict[str, Any] = {"asked": asked, "answered": int(len(keep))}
        if len(keep) == 0:
            result["accuracy"] = math.nan
            return result
        started = time.perf_counter()
        if self.rounds.clusters is not None:  # each answered medoid labels its cluster
            keep, labels = self.rounds.cluster_labels(keep, labels)
            result["cluster_labelled"] = int(len(keep))
            if not self.public.unlabeled:  # measured with the pool's truth, never trained on
                result["cluster_label_accuracy"] = float((labels == self.public.y[keep]).mean())
        if self.trainer.label_propagation is not None:
            keep, labels, result["propagated"] = self.trainer.propagated(keep, labels)
        model, added = self.trainer.train_on(keep, labels, progress)
        result.update(added)
        # Post-processing of released labels and public inputs: its time says nothing more of the records.
        result["train_seconds"] = time.perf_counter() - started
        result["accuracy"] = self.trainer.accuracy(model)
        self._last_model = model
        return result

    def network(self) -> NetworkEmbedding | None:
        """The last model trained as a checkpoint and an embedding (``StudentTrainer.network``);
        None before any training."""
        return None if self._last_model is None else self.trainer.network(self._last_model)

    def learning_curve(self, progress: bool = False) -> list[dict[str, Any]]:
        """``fit_and_evaluate`` at every checkpoint recorded by ``query``, with its budget."""
        curve = []
        for snapshot in self.snapshots:
            point = self.fit_and_evaluate(snapshot["asked"], progress=progress)
            point["budget"] = snapshot["budget"]
            log.info("student: %d asked, %d answered → test accuracy %.4f",
                     point["asked"], point["answered"], point["accuracy"])
            curve.append(point)
        return curve


# The Ray actor: the same class, imported by module path in the worker.
StudentActor = ray.remote(Student)
