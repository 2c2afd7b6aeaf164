"""How a student model learns from released labels and the public pool: supervised, by
self-training, FixMatch or label propagation; several members averaged; test predictions over views.

All of it post-processing of released labels and public inputs. ``actors.student`` asks the
aggregator and trains through a ``StudentTrainer``; a non-private reference (every pool input
with its true label) trains through the same one, so it trains exactly as the private runs do.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from conclave.errors import InvalidValue
from conclave.learning.data import Dataset
from conclave.learning.data.features import apply_features, batch_transform
from conclave.learning.data.schema import Standardiser
from conclave.learning.embeddings import NetworkEmbedding
from conclave.learning.label_propagation import LabelPropagationConfig, propagate
from conclave.learning.models import build_model, model_label
from conclave.learning.models.averaged import AveragedStudents
from conclave.learning.semi_supervised import FixMatchConfig, fixmatch
from conclave.learning.train_config import TrainConfig
from conclave.learning.training import evaluate, fit, predict_logits
from conclave.learning.view_averaging import predict_with_views


class StudentTrainer:
    """Trains the student's models on pool indices and their labels, and scores them on ``test``.

    Args:
        public: the unlabeled pool (its ``y`` is never trained on here).
        test: held-out split the models are scored on.
        model_name: a ``learning.models.build_model`` name, or the factory itself.
        train: how each model is trained (``train.seed`` seeds its initial weights).
        features: the representation the model learns on (None: the inputs themselves).
        pseudo_label_threshold: self-training at this confidence (None: off).
        semi_supervised: FixMatch settings (None: off); exclusive with self-training.
        label_propagation: spread the answers over the pool first (None: off); exclusive with
            self-training, combines with FixMatch.
        standardiser: public column statistics for a table model.
        members: models trained alike from consecutive seeds and averaged (free post-processing).
        test_views: each test prediction averages the image and this many weak views of it
            (``learning.view_averaging``; images only).
    """

    def __init__(
        self,
        public: Dataset,
        test: Dataset,
        model_name: str | Callable[..., Any],
        train: TrainConfig,
        features: str | None = None,
        pseudo_label_threshold: float | None = None,
        semi_supervised: FixMatchConfig | None = None,
        standardiser: Standardiser | None = None,
        label_propagation: LabelPropagationConfig | None = None,
        members: int = 1,
        test_views: int = 0,
    ) -> None:
        if semi_supervised is not None and not public.is_image:
            raise InvalidValue("FixMatch (semi_supervised) augments images; for table inputs use "
                             "pseudo_label_threshold or neither")
        if pseudo_label_threshold is not None and not 0 < pseudo_label_threshold <= 1:
            raise InvalidValue(f"pseudo_label_threshold must be in (0, 1] or None, got {pseudo_label_threshold}")
        if pseudo_label_threshold is not None and semi_supervised is not None:
            raise InvalidValue("choose self-training (pseudo_label_threshold) or FixMatch (semi_supervised), not both")
        if pseudo_label_threshold is not None and label_propagation is not None:
            raise InvalidValue("choose self-training (pseudo_label_threshold) or label_propagation, not both")
        if members < 1:
            raise InvalidValue(f"members must be >= 1, got {members}")
        if test_views < 0 or (test_views and not test.is_image):
            raise InvalidValue(f"test_views averages augmented images: it must be 0 for table inputs and >= 0, "
                             f"got {test_views}")
        self.public = public
        self.test = apply_features(test, features)
        self._test_images = test  # as they are: test views augment them before the features
        self.model_name = model_name
        self.train_config = train
        self.features = features
        self.pseudo_label_threshold = pseudo_label_threshold
        self.semi_supervised = semi_supervised
        self.standardiser = standardiser
        self.label_propagation = label_propagation
        self.members = members
        self.test_views = test_views
        self._pool_inputs: np.ndarray | None = None  # the whole pool as the model sees it, on first use

    def pool(self) -> np.ndarray:
        """The whole public pool as the model sees it (its ``features``)."""
        if self._pool_inputs is None:
            self._pool_inputs = apply_features(self.public, self.features).x
        return self._pool_inputs

    def train_on(self, keep: np.ndarray, labels: np.ndarray, progress: bool = False) -> tuple[torch.nn.Module, dict[str, Any]]:
        """A fresh model trained as the student trains (FixMatch over the pool, or supervised with
        self-training if configured), on pool indices ``keep`` labelled ``labels``; with ``members``
        above 1, that many trained alike from consecutive seeds, averaged (``AveragedStudents``).
        Returns it and what self-training added (the first member's)."""
        trained = [self._train_member(keep, labels, member, progress) for member in range(self.members)]
        if self.members == 1:
            return trained[0]
        return AveragedStudents([model for model, _ in trained]), trained[0][1]

    def accuracy(self, model: torch.nn.Module) -> float:
        """``model``'s accuracy on the test split, predicting as the student does (with its test views)."""
        if not self.test_views:
            return evaluate(model, self.test)
        represent = batch_transform(self.features, self._test_images.x.shape[-2:])
        predicted = predict_with_views(model, self._test_images.x, represent, self.test_views, self.train_config.seed)
        return float(np.mean(predicted == self._test_images.y))

    def network(self, model: torch.nn.Module) -> NetworkEmbedding:
        """``model`` (of several members, the first) as a checkpoint and an embedding
        (``learning.embeddings``): trained on released labels and public inputs only, so it can embed
        a later round's votes at no cost (a table model's public standardiser is in its buffers)."""
        model = model.first if isinstance(model, AveragedStudents) else model
        state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
        return NetworkEmbedding(model_label(self.model_name), self.public.num_classes, tuple(self.test.input_shape),
                                self.features, state)

    def propagated(self, keep: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """The answered indices and labels, plus the pool inputs label propagation labels
        confidently (and how many it added); answered inputs keep their released labels."""
        pool = self.pool()
        if self.standardiser is not None:  # table columns on one scale, by public statistics
            pool = (pool - self.standardiser.mean) / self.standardiser.scale
        spread = propagate(pool, keep, labels, self.public.num_classes, self.label_propagation)
        added = np.setdiff1d(spread.confident(self.label_propagation.threshold), keep)
        return np.concatenate([keep, added]), np.concatenate([labels, spread.labels[added]]), int(len(added))

    def fit_fresh(self, training: Dataset, progress: bool = False, member: int = 0) -> torch.nn.Module:
        """A fresh model of member ``member``'s seed, fitted to ``training`` supervised."""
        model = self._new_model(training.input_shape, member)
        fit(model, training, self._member_train_config(member), progress=progress)
        return model

    def _train_member(self, keep: np.ndarray, labels: np.ndarray, member: int,
                      progress: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
        """One model as ``train_on`` describes; member m's seeds (weights, batch order, augmentations)
        are the configured ones plus m, so member 0 is the single student's."""
        if self.semi_supervised is not None:
            return self._fit_fixmatch(keep, labels, progress, member), {}
        # Without self-training only the labelled images are transformed: the pool is large.
        answers = Dataset(self.public.x[keep], labels, self.public.num_classes, "student/answered")
        model = self.fit_fresh(apply_features(answers, self.features), progress, member)
        if self.pseudo_label_threshold is None:
            return model, {}
        pool = self.pool()
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
        return self.fit_fresh(training, progress, member), added

    def _member_train_config(self, member: int) -> TrainConfig:
        """Member m's training settings: the configured seed (initial weights, batch order) plus m."""
        return dataclasses.replace(self.train_config, seed=self.train_config.seed + member)

    def _new_model(self, input_shape: tuple[int, ...], member: int) -> torch.nn.Module:
        return build_model(self.model_name, self.public.num_classes, input_shape=input_shape,
                           standardiser=self.standardiser, seed=self._member_train_config(member).seed)

    def _fit_fixmatch(self, keep: np.ndarray, labels: np.ndarray, progress: bool, member: int) -> torch.nn.Module:
        """FixMatch on the answered images and the whole pool; the model reads ``features``;
        member m's augmentations and batch order are drawn from the configured seed plus m."""
        model = self._new_model(self.test.input_shape, member)
        settings = dataclasses.replace(self.semi_supervised, seed=self.semi_supervised.seed + member)
        fixmatch(model, self.public.x[keep], labels, self.public.x, settings,
                 represent=batch_transform(self.features, self.public.x.shape[-2:]), progress=progress)
        return model
