"""The student: public inputs in, private labels from the aggregator over gRPC, a model out.

An ordinary gRPC client of the aggregator (through an injected client factory), as an outside
party would be. It chooses its queries (``QuerySelection``) from public inputs and released
labels, asks no more than the budget pays for, and learns from the answers supervised, by
self-training, FixMatch or label propagation: all post-processing. The pool's true labels only
measure label accuracy.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray
import torch
from tqdm import tqdm

from conclave.learning.data import Dataset
from conclave.learning.data.features import apply_features, batch_transform
from conclave.learning.data.schema import Standardiser
from conclave.learning.embeddings import Embedding, NetworkEmbedding
from conclave.learning.label_propagation import LabelPropagationConfig, propagate
from conclave.learning.models import build_model, model_label
from conclave.learning.models.averaged import AveragedStudents
from conclave.learning.selection import CLUSTERS, POOL_ORDER, PublicPool, QuerySelection, build_strategy
from conclave.learning.selection.clusters import PoolClusters, cluster_pool
from conclave.learning.selection.cold_start import kmeans_cold_start
from conclave.learning.semi_supervised import FixMatchConfig, fixmatch
from conclave.learning.view_averaging import predict_with_views
from conclave.learning.train_config import TrainConfig
from conclave.learning.training import embed, evaluate, fit, predict_logits
from conclave.progress import COUNTS

log = logging.getLogger(__name__)

ABSTAIN = -1


class Student:
    """Holds the public pool and the answers it has received (plain class; see ``StudentActor``).

    Args:
        public: the unlabeled pool (its ``y`` only measures label accuracy).
        test: held-out split the student is evaluated on.
        model_name: a ``learning.models.build_model`` name, or the factory itself.
        train: how each student model is trained (``train.seed`` seeds its initial weights).
        client_factory: builds a connected aggregator client (``label_reply``, ``budget``,
            ``is_budget_refusal``, ``close``: ``cluster.client.AggregatorClient``).
        features: the representation the student's model learns on (None: the images).
        pseudo_label_threshold: self-training at this confidence (None: off).
        semi_supervised: FixMatch settings (None: off); exclusive with self-training.
        label_propagation: spread the answers over the pool first (None: off); exclusive with
            self-training, combines with FixMatch.
        selection: which pool inputs to ask about.
        standardiser: public column statistics for a table model.
        cluster_embedding: the vote source's public embedding, where "clusters" selection cuts the
            pool (public-cluster votes: each answered medoid labels its cluster).
        members: students trained alike from consecutive seeds and averaged (free post-processing).
        test_views: each test prediction averages the image and this many weak views of it
            (``learning.view_averaging``; free post-processing; images only).
    """

    def __init__(
        self,
        public: Dataset,
        test: Dataset,
        model_name: str | Callable[..., Any],
        train: TrainConfig,
        client_factory: Callable[[], Any],
        num_threads: int | None = None,
        features: str | None = None,
        pseudo_label_threshold: float | None = None,
        semi_supervised: FixMatchConfig | None = None,
        selection: QuerySelection = QuerySelection(),
        standardiser: Standardiser | None = None,
        label_propagation: LabelPropagationConfig | None = None,
        cluster_embedding: Embedding | None = None,
        members: int = 1,
        test_views: int = 0,
    ) -> None:
        if semi_supervised is not None and not public.is_image:
            raise ValueError("FixMatch (semi_supervised) augments images; for table inputs use "
                             "pseudo_label_threshold or neither")
        if pseudo_label_threshold is not None and not 0 < pseudo_label_threshold <= 1:
            raise ValueError(f"pseudo_label_threshold must be in (0, 1] or None, got {pseudo_label_threshold}")
        if pseudo_label_threshold is not None and semi_supervised is not None:
            raise ValueError("choose self-training (pseudo_label_threshold) or FixMatch (semi_supervised), not both")
        if pseudo_label_threshold is not None and label_propagation is not None:
            raise ValueError("choose self-training (pseudo_label_threshold) or label_propagation, not both")
        if members < 1:
            raise ValueError(f"members must be >= 1, got {members}")
        if test_views < 0 or (test_views and not test.is_image):
            raise ValueError(f"test_views averages augmented images: it must be 0 for table inputs and >= 0, "
                             f"got {test_views}")
        if selection.strategy == CLUSTERS and cluster_embedding is None:
            raise ValueError("clusters selection needs the vote source's public embedding (cluster_embedding)")
        if num_threads is not None:  # in an actor: as many threads as the CPUs it reserved
            torch.set_num_threads(max(1, num_threads))
        self.public = public  # images: what the student asks about
        self.cluster_embedding = cluster_embedding
        self.clusters: PoolClusters | None = None  # the last "clusters" round's cut of the pool
        self.features = features
        self.pseudo_label_threshold = pseudo_label_threshold
        self.semi_supervised = semi_supervised
        self.label_propagation = label_propagation
        self.selection = selection
        self.members = members
        self._pool_inputs: np.ndarray | None = None  # the whole pool as the model sees it, on first use
        self.test = apply_features(test, features)
        self._test_images = test  # as they are: test views augment them before the features
        self.test_views = test_views
        self.model_name = model_name
        self.standardiser = standardiser
        self.train_config = train
        self.client_factory = client_factory
        self.labels = np.full(len(public), ABSTAIN, dtype=np.int64)  # by pool index
        self.asked_order: list[int] = []  # pool indices, in the order they were asked
        self._round: list[int] = []  # chosen for the current round, not asked yet
        self._rng = np.random.default_rng(selection.seed)
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
            raise ValueError(f"num_queries must be in [1, {len(self.public)}] (pool size), got {num_queries}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
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
                    chosen = self._next_batch(min(batch_size, stop - self.asked, affordable))
                    try:
                        reply = self._client.label_reply(self.public.x[chosen])
                    except Exception as err:  # only a budget refusal is an expected end
                        if not self._client.is_budget_refusal(err):
                            raise
                        log.warning("aggregator refused at %d queries: privacy budget exhausted", self.asked)
                        self.exhausted = True
                        self._round = [*chosen.tolist(), *self._round]  # not asked after all
                        break
                    calls += 1
                    budget = reply.budget
                    # Another client spent the budget since it was read and it paid for part of the
                    # batch: keep those answers and ask again for the rest when it pays for them.
                    asked, refused = chosen[~reply.refused], chosen[reply.refused]
                    self.labels[asked] = reply.labels[~reply.refused]
                    self.asked_order.extend(asked.tolist())
                    bar.update(len(asked))
                    self._round = [*refused.tolist(), *self._round]
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

    # ---- which inputs to ask ----

    def _next_batch(self, count: int) -> np.ndarray:
        """The next ``count`` pool indices to ask: from the current round, choosing a new one when it is spent."""
        if not self._round:
            self._round = self._choose_round().tolist()
        chosen, self._round = self._round[:count], self._round[count:]
        return np.asarray(chosen, dtype=np.int64)

    def _choose_round(self) -> np.ndarray:
        unasked = np.setdiff1d(np.arange(len(self.public)), np.asarray(self.asked_order, dtype=np.int64))
        size = min(self.selection.round_size, len(unasked))
        answered = np.asarray([i for i in self.asked_order if self.labels[i] != ABSTAIN], dtype=np.int64)
        cold = len(np.unique(self.labels[answered])) < 2  # nothing to learn from yet
        if self.selection.strategy == CLUSTERS:  # one medoid per cluster of the pool, largest first
            self.clusters = cluster_pool(self.cluster_embedding(self.public.x), size, self.selection.seed)
            return np.asarray([m for m in self.clusters.medoids if m in set(unasked.tolist())], dtype=np.int64)
        if self.selection.strategy == POOL_ORDER:
            if not (cold and self.selection.cold_start == "kmeans"):
                return unasked  # setdiff1d keeps the pool's order
            first = kmeans_cold_start(self._pool(), unasked, size, self.selection.seed)
            return np.concatenate([first, np.setdiff1d(unasked, first)])  # then the rest in pool order
        if cold:
            if self.selection.cold_start == "kmeans":
                return kmeans_cold_start(self._pool(), unasked, size, self.selection.seed)
            return self._rng.choice(unasked, size=size, replace=False)
        pool = self._pool()
        model = self._fit_fresh(Dataset(pool[answered], self.labels[answered], self.public.num_classes,
                                        "student/answered", self.features), progress=False, member=0)
        candidates = PublicPool(predict_logits(model, pool[unasked]), embed(model, pool[unasked]))
        picked = build_strategy(self.selection.strategy).select(candidates, [size], self._rng)[size]
        return unasked[picked]

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
        if self.clusters is not None:  # each answered medoid labels its cluster
            keep, labels = self._cluster_labels(keep, labels)
            result["cluster_labelled"] = int(len(keep))
            if not self.public.unlabeled:  # measured with the pool's truth, never trained on
                result["cluster_label_accuracy"] = float((labels == self.public.y[keep]).mean())
        if self.label_propagation is not None:
            keep, labels, result["propagated"] = self._fit_propagated_labels(keep, labels)
        model, added = self.train_on(keep, labels, progress)
        result.update(added)
        # Post-processing of released labels and public inputs: its time says nothing more of the records.
        result["train_seconds"] = time.perf_counter() - started
        result["accuracy"] = self.accuracy(model)
        self._last_model = model
        return result

    def train_on(self, keep: np.ndarray, labels: np.ndarray, progress: bool = False) -> tuple[torch.nn.Module, dict[str, Any]]:
        """A fresh model trained as this student trains (FixMatch over the pool, or supervised with
        self-training if configured), on pool indices ``keep`` labelled ``labels``; with ``members``
        above 1, that many trained alike from consecutive seeds, averaged (``AveragedStudents``).
        Returns it and what self-training added (the first member's). Public, so that a non-private
        reference (the ceiling: every pool input with its true label) trains exactly as the private
        runs do."""
        trained = [self._train_member(keep, labels, member, progress) for member in range(self.members)]
        if self.members == 1:
            return trained[0]
        return AveragedStudents([model for model, _ in trained]), trained[0][1]

    def _train_member(self, keep: np.ndarray, labels: np.ndarray, member: int,
                      progress: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
        """One model as ``train_on`` describes; member m's seeds (weights, batch order, augmentations)
        are the configured ones plus m, so member 0 is the single student's."""
        if self.semi_supervised is not None:
            return self._fit_fixmatch(keep, labels, progress, member), {}
        # Without self-training only the labelled images are transformed: the pool is large.
        answers = Dataset(self.public.x[keep], labels, self.public.num_classes, "student/answered")
        model = self._fit_fresh(apply_features(answers, self.features), progress, member)
        if self.pseudo_label_threshold is None:
            return model, {}
        pool = self._pool()
        others = np.setdiff1d(np.arange(len(pool)), keep)
        confident, guessed = others, np.zeros(0, dtype=labels.dtype)  # every image labelled: none to guess
        if len(others):
            probabilities = torch.softmax(torch.from_numpy(predict_logits(model, pool[others])), dim=1).numpy()
            sure = probabilities.max(axis=1) >= self.pseudo_label_threshold
            confident, guessed = others[sure], probabilities[sure].argmax(axis=1)
        training = Dataset(np.concatenate([pool[keep], pool[confident]]), np.concatenate([labels, guessed]),
                           self.public.num_classes, "student/self-trained", self.features)
        added = {"supervised_accuracy": self.accuracy(model),  # what self-training adds
                 "pseudo_labelled": int(len(confident))}
        return self._fit_fresh(training, progress, member), added

    def accuracy(self, model: torch.nn.Module) -> float:
        """``model``'s accuracy on the test split, predicting as this student does (with its test views)."""
        if not self.test_views:
            return evaluate(model, self.test)
        represent = batch_transform(self.features, self._test_images.x.shape[-2:])
        predicted = predict_with_views(model, self._test_images.x, represent, self.test_views, self.train_config.seed)
        return float(np.mean(predicted == self._test_images.y))

    def network(self) -> NetworkEmbedding | None:
        """The last model trained (of several members, the first), as a checkpoint and an embedding
        (``learning.embeddings``): trained on released labels and public inputs only, so it can embed
        a later round's votes at no cost (a table model's public standardiser is in its buffers).
        None before any training."""
        if self._last_model is None:
            return None
        model = self._last_model.first if isinstance(self._last_model, AveragedStudents) else self._last_model
        state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
        return NetworkEmbedding(model_label(self.model_name), self.public.num_classes, tuple(self.test.input_shape), self.features,
                                state)

    def _cluster_labels(self, keep: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The pool inputs the answered medoids label, and their labels (``QuerySelection.spread_medoids``)."""
        spread = self.clusters.spread(dict(zip(keep.tolist(), labels.tolist())), self.selection.spread_medoids,
                                      self.selection.spread_decay, self.selection.spread_margin)
        members = np.fromiter(spread, dtype=np.int64, count=len(spread))
        return members, np.fromiter(spread.values(), dtype=np.int64, count=len(spread))

    def _fit_propagated_labels(self, keep: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """The answered indices and labels, plus the pool inputs label propagation labels
        confidently (and how many it added); answered inputs keep their released labels."""
        pool = self._pool()
        if self.standardiser is not None:  # table columns on one scale, by public statistics
            pool = (pool - self.standardiser.mean) / self.standardiser.scale
        spread = propagate(pool, keep, labels, self.public.num_classes, self.label_propagation)
        added = np.setdiff1d(spread.confident(self.label_propagation.threshold), keep)
        return np.concatenate([keep, added]), np.concatenate([labels, spread.labels[added]]), int(len(added))

    def _pool(self) -> np.ndarray:
        if self._pool_inputs is None:
            self._pool_inputs = apply_features(self.public, self.features).x
        return self._pool_inputs

    def _member_train_config(self, member: int) -> TrainConfig:
        """Member m's training settings: the configured seed (initial weights, batch order) plus m."""
        return dataclasses.replace(self.train_config, seed=self.train_config.seed + member)

    def _new_model(self, input_shape: tuple[int, ...], member: int) -> torch.nn.Module:
        return build_model(self.model_name, self.public.num_classes, input_shape=input_shape,
                           standardiser=self.standardiser, seed=self._member_train_config(member).seed)

    def _fit_fresh(self, training: Dataset, progress: bool, member: int) -> torch.nn.Module:
        model = self._new_model(training.input_shape, member)
        fit(model, training, self._member_train_config(member), progress=progress)
        return model

    def _fit_fixmatch(self, keep: np.ndarray, labels: np.ndarray, progress: bool, member: int) -> torch.nn.Module:
        """FixMatch on the answered images and the whole pool; the model reads ``features``;
        member m's augmentations and batch order are drawn from the configured seed plus m."""
        model = self._new_model(self.test.input_shape, member)
        settings = dataclasses.replace(self.semi_supervised, seed=self.semi_supervised.seed + member)
        fixmatch(model, self.public.x[keep], labels, self.public.x, settings,
                 represent=batch_transform(self.features, self.public.x.shape[-2:]), progress=progress)
        return model

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
