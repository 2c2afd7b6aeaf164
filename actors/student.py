"""The student: public inputs in, private labels from the aggregator over gRPC, a model out.

The student never touches a teacher: it is an ordinary gRPC client of the aggregator
(through the client factory the caller injects, so this module does not depend on
``cluster/``), exactly as an outside party would be. It trains only on the labels the
aggregator released (abstentions are dropped) and is evaluated on the held-out test split.

The public pool's ground-truth labels are kept only to measure how often the released
labels are right (the papers' "label accuracy"); they are never used for training.

With ``features`` (see ``learning.data.features``) the student still asks about images, as
any client does, but its model learns on and is evaluated on their features, computed here.

With ``pseudo_label_threshold`` the student is semi-supervised by self-training (Lee 2013):
after learning from the answers, it labels the rest of its public pool with its own
predictions where their softmax confidence reaches the threshold, and a fresh model learns
from the answers and those. PATE's students are semi-supervised too (PATE 2018 uses GANs).
This is post-processing of released labels with public inputs, so it costs no privacy.
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

from learning.data import Dataset
from learning.data.features import apply_features
from learning.models import build_model
from learning.training import TrainConfig, evaluate, fit, predict_logits

log = logging.getLogger(__name__)

ABSTAIN = -1


def _is_budget_refusal(err: Exception) -> bool:
    """True for the gRPC RESOURCE_EXHAUSTED status: the ledger refused, nothing was released."""
    code = getattr(err, "code", None)
    return callable(code) and getattr(code(), "name", "") == "RESOURCE_EXHAUSTED"


class Student:
    """Holds the public pool and the answers it has received (plain class; see ``StudentActor``).

    Args:
        public: the unlabeled pool (its ``y`` only measures label accuracy).
        test: held-out split the student is evaluated on.
        model_name: a ``learning.models.build_model`` name.
        train: how each student model is trained (``train.seed`` seeds its initial weights).
        client_factory: builds a connected aggregator client (``label``, ``budget``, ``close``).
        features: the representation the student's model learns on (None: the images).
    """

    def __init__(
        self,
        public: Dataset,
        test: Dataset,
        model_name: str,
        train: TrainConfig,
        client_factory: Callable[[], Any],
        num_threads: int | None = None,
        features: str | None = None,
        pseudo_label_threshold: float | None = None,
    ) -> None:
        if pseudo_label_threshold is not None and not 0 < pseudo_label_threshold <= 1:
            raise ValueError(f"pseudo_label_threshold must be in (0, 1] or None, got {pseudo_label_threshold}")
        if num_threads is not None:  # in an actor: as many threads as the CPUs it reserved
            torch.set_num_threads(max(1, num_threads))
        self.public = public  # images: what the student asks about
        self.features = features
        self.pseudo_label_threshold = pseudo_label_threshold
        self._pool_inputs: np.ndarray | None = None  # the whole pool as the model sees it, on first use
        self.test = apply_features(test, features)
        self.model_name = model_name
        self.train_config = train
        self.client_factory = client_factory
        self.labels = np.full(len(public), ABSTAIN, dtype=np.int64)
        self.asked = 0
        self.exhausted = False  # the aggregator refused: no budget left
        self.query_seconds = 0.0
        self.snapshots: list[dict[str, Any]] = []
        self._client: Any = None

    def query(
        self,
        num_queries: int,
        batch_size: int = 256,
        checkpoints: Sequence[int] = (),
        progress: bool = True,
        max_batches: int | None = None,
    ) -> dict[str, Any]:
        """Ask for labels of the first ``num_queries`` pool inputs, ``batch_size`` per call.

        After each checkpoint (a number of inputs asked) the aggregator's budget is read and
        kept, so accuracy can later be plotted against ε. Stops early, keeping every answer
        received, when the aggregator refuses for lack of budget. With ``max_batches`` it
        returns after that many calls and a later call carries on where it stopped (so a
        driver can show progress while the student runs in an actor).
        """
        if not 1 <= num_queries <= len(self.public):
            raise ValueError(f"num_queries must be in [1, {len(self.public)}] (pool size), got {num_queries}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        stops = sorted({c for c in checkpoints if 0 < c < num_queries} | {num_queries})
        if self._client is None:
            self._client = self.client_factory()
        started = time.perf_counter()
        calls = 0
        with tqdm(total=num_queries, initial=self.asked, desc="student queries", unit="query",
                  disable=not progress) as bar:
            for stop in (s for s in stops if s > self._last_snapshot()):
                while self.asked < stop and not self.exhausted and (max_batches is None or calls < max_batches):
                    end = min(self.asked + batch_size, stop)
                    try:
                        self.labels[self.asked:end] = self._client.label(self.public.x[self.asked:end])
                    except Exception as err:  # only a budget refusal is an expected end
                        if not _is_budget_refusal(err):
                            raise
                        log.warning("aggregator refused at %d queries: privacy budget exhausted", self.asked)
                        self.exhausted = True
                        break
                    bar.update(end - self.asked)
                    self.asked = end
                    calls += 1
                if self.asked == stop or self.exhausted:
                    self.snapshots.append(self._snapshot(self._client.budget()))
                if self.asked < stop:
                    break
        self.query_seconds += time.perf_counter() - started
        return self.summary()

    def _last_snapshot(self) -> int:
        return self.snapshots[-1]["asked"] if self.snapshots else 0

    def _snapshot(self, budget: dict[str, Any]) -> dict[str, Any]:
        answered = int((self.labels[: self.asked] != ABSTAIN).sum())
        return {"asked": self.asked, "answered": answered, "budget": dict(budget)}

    def summary(self) -> dict[str, Any]:
        """What the queries so far gave: counts, label accuracy, speed and the checkpoints."""
        seconds = self.query_seconds
        return {
            "asked": self.asked,
            "answered": int((self.labels[: self.asked] != ABSTAIN).sum()),
            "budget_exhausted": self.exhausted,
            "label_accuracy": self.label_accuracy(),
            "query_seconds": seconds,
            "labels_per_second": self.asked / seconds if seconds > 0 else math.nan,
            "checkpoints": list(self.snapshots),
        }

    def close(self) -> None:
        """Close the connection to the aggregator."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def label_accuracy(self) -> float:
        """Fraction of released labels that match the pool's ground truth (nan if none)."""
        answered = self.labels[: self.asked] != ABSTAIN
        if not answered.any():
            return math.nan
        return float((self.labels[: self.asked][answered] == self.public.y[: self.asked][answered]).mean())

    def fit_and_evaluate(self, asked: int | None = None, progress: bool = False) -> dict[str, Any]:
        """Train a fresh model on the answers among the first ``asked`` queries; test accuracy."""
        asked = self.asked if asked is None else min(asked, self.asked)
        labels = self.labels[:asked]
        keep = np.flatnonzero(labels != ABSTAIN)
        result: dict[str, Any] = {"asked": asked, "answered": int(len(keep))}
        if len(keep) == 0:
            result["accuracy"] = math.nan
            return result
        answers = Dataset(self.public.x[keep], labels[keep], self.public.num_classes, "student/answered")
        # Without self-training only the asked images are transformed: the pool is large.
        training = apply_features(answers, self.features)
        started = time.perf_counter()
        model = self._fit_fresh(training, progress)
        if self.pseudo_label_threshold is not None:
            pool = self._pool()
            others = np.setdiff1d(np.arange(len(pool)), keep)
            probabilities = torch.softmax(torch.from_numpy(predict_logits(model, pool[others])), dim=1).numpy()
            sure = probabilities.max(axis=1) >= self.pseudo_label_threshold
            confident, guessed = others[sure], probabilities[sure].argmax(axis=1)
            training = Dataset(np.concatenate([pool[keep], pool[confident]]), np.concatenate([labels[keep], guessed]),
                               self.public.num_classes, "student/self-trained", self.features)
            result["supervised_accuracy"] = evaluate(model, self.test)  # what self-training adds
            model = self._fit_fresh(training, progress)
            result["pseudo_labelled"] = int(len(confident))
        result["train_seconds"] = time.perf_counter() - started
        result["accuracy"] = evaluate(model, self.test)
        return result

    def _pool(self) -> np.ndarray:
        if self._pool_inputs is None:
            self._pool_inputs = apply_features(self.public, self.features).x
        return self._pool_inputs

    def _fit_fresh(self, training: Dataset, progress: bool) -> torch.nn.Module:
        _, channels, _, side = training.x.shape
        model = build_model(self.model_name, self.public.num_classes, in_channels=int(channels),
                            seed=self.train_config.seed, input_size=int(side))
        fit(model, training, self.train_config, progress=progress)
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
