"""Teachers: models trained on disjoint private shards, packed several to a Ray actor.

PATE at the papers' scale has 250 teachers; one actor per teacher would start 250 Python
processes on a 2-core machine. Instead each actor (a ``TeacherGroup``) holds the shards of
several teachers, trains them one after another, and answers vote requests for all of
them at once. The actors train in parallel with each other.

What leaves an actor: a vote histogram ``int[batch, k]`` summed over its teachers (the
driver adds the actors' partial histograms), and each teacher's final training loss for the
operator's log. Per-teacher predictions, models and data stay inside the actor; only the
aggregator's DP mechanism turns histograms into answers for anyone else.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time

import numpy as np
import ray
import torch
from tqdm import tqdm

from learning.data import Dataset
from learning.models import build_model
from learning.training import TrainConfig, fit, predict

log = logging.getLogger(__name__)


def teacher_seed(base_seed: int, teacher: int) -> int:
    """Seed of one teacher's initialisation and batch order: distinct per teacher, repeatable."""
    return base_seed * 100_003 + teacher


def gpu_share(cluster_gpus: float, num_actors: int) -> float:
    """GPUs each actor asks for: an equal share (at most one each), or 0 without GPUs."""
    return min(1.0, cluster_gpus / num_actors) if cluster_gpus > 0 else 0.0


class TeacherGroup:
    """Several teachers in one process: no Ray here, so a benchmark can run it in-process.

    ``first_teacher`` is the global index of ``shards[0]``; seeds follow global indices,
    so the same teacher gets the same seed however the teachers are packed.
    """

    def __init__(
        self,
        shards: list[Dataset],
        model_name: str,
        train: TrainConfig,
        first_teacher: int = 0,
        num_threads: int | None = None,
    ) -> None:
        if not shards:
            raise ValueError("a teacher group needs at least one shard")
        if num_threads is not None:  # in an actor: as many threads as the CPUs it reserved
            torch.set_num_threads(max(1, num_threads))
        self.shards = shards
        self.train_config = train
        self.first_teacher = first_teacher
        self.model_name = model_name
        self.num_classes = shards[0].num_classes
        self.models: list[torch.nn.Module | None] = [None] * len(shards)

    def train_teacher(self, local_index: int) -> float:
        """Train one teacher on its own shard; returns its last epoch's mean loss."""
        shard = self.shards[local_index]
        seed = teacher_seed(self.train_config.seed, self.first_teacher + local_index)
        model = build_model(self.model_name, self.num_classes, in_channels=int(shard.x.shape[1]), seed=seed)
        losses = fit(model, shard, dataclasses.replace(self.train_config, seed=seed))
        model.eval()
        self.models[local_index] = model
        return float(losses[-1]) if losses else float("nan")

    def train_all(self) -> list[float]:
        return [self.train_teacher(i) for i in range(len(self.models))]

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        """Histogram ``int64[batch, k]`` of this group's teachers' predicted classes."""
        if any(model is None for model in self.models):
            raise RuntimeError("teachers must be trained before they vote")
        histogram = np.zeros((len(inputs), self.num_classes), dtype=np.int64)
        rows = np.arange(len(inputs))
        for model in self.models:
            predicted = predict(model, inputs)
            np.add.at(histogram, (rows, predicted), 1)
        return histogram


# The Ray actor is the same class; Ray imports it by module path in the worker.
TeacherGroupActor = ray.remote(TeacherGroup)


class TeacherPool:
    """Driver-side handle over the teacher actors; the vote source of the aggregator.

    Args:
        shards: one private dataset per teacher (disjoint).
        model_name: a ``learning.models.build_model`` name.
        train: training settings; ``train.seed`` is the base of every teacher's seed.
        num_actors: how many Ray actors share the teachers (capped at the number of teachers).
        seed: base seed (replaces ``train.seed`` when given, so one config seed drives a run).
        num_cpus_per_actor: CPUs each actor reserves; also its torch thread count (≥ 1).
        num_gpus: GPU fraction per actor; ``None`` detects: a share of the cluster's GPUs
            when it has any, else 0 (a CPU-only cluster never waits on a GPU request).
    """

    def __init__(
        self,
        shards: list[Dataset],
        model_name: str,
        train: TrainConfig,
        num_actors: int,
        seed: int | None = None,
        num_cpus_per_actor: float = 1.0,
        num_gpus: float | None = None,
    ) -> None:
        if not shards:
            raise ValueError("TeacherPool needs at least one shard")
        if num_actors < 1:
            raise ValueError(f"num_actors must be >= 1, got {num_actors}")
        if seed is not None:
            train = dataclasses.replace(train, seed=seed)
        self.num_teachers = len(shards)
        self.num_classes = shards[0].num_classes
        self.input_shape = tuple(int(d) for d in shards[0].x.shape[1:])
        num_actors = min(num_actors, self.num_teachers)
        if num_gpus is None:
            num_gpus = gpu_share(float(ray.cluster_resources().get("GPU", 0.0)), num_actors)
        # Contiguous blocks of teachers per actor, sizes differing by at most one.
        bounds = np.linspace(0, self.num_teachers, num_actors + 1).round().astype(int)
        self._blocks = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        threads = max(1, math.floor(num_cpus_per_actor))
        self._actors = [
            TeacherGroupActor.options(num_cpus=num_cpus_per_actor, num_gpus=num_gpus).remote(
                shards[a:b], model_name, train, first_teacher=a, num_threads=threads
            )
            for a, b in self._blocks
        ]
        log.info(
            "%d teachers on %d actors (%s CPU, %s GPU each)",
            self.num_teachers, len(self._actors), num_cpus_per_actor, num_gpus,
        )

    @property
    def num_actors(self) -> int:
        return len(self._actors)

    def ready(self) -> None:
        """Block until every actor has started (process up, shards received)."""
        ray.get([actor.__ray_ready__.remote() for actor in self._actors])

    def train(self, progress: bool = True) -> list[float]:
        """Train every teacher (actors in parallel); returns each teacher's last-epoch loss."""
        started = time.perf_counter()
        pending = {}
        for actor, (first, last) in zip(self._actors, self._blocks):
            for local in range(last - first):
                pending[actor.train_teacher.remote(local)] = first + local
        losses = [math.nan] * self.num_teachers
        with tqdm(total=self.num_teachers, desc="training teachers", unit="teacher", disable=not progress) as bar:
            remaining = list(pending)
            while remaining:
                done, remaining = ray.wait(remaining, num_returns=1)
                losses[pending[done[0]]] = ray.get(done[0])
                bar.update(1)
        log.info("trained %d teachers in %.1f s", self.num_teachers, time.perf_counter() - started)
        return losses

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        """Vote histogram ``int64[batch, num_classes]``: the actors' partial histograms added."""
        inputs = np.ascontiguousarray(inputs, dtype=np.float32)
        if inputs.shape[1:] != self.input_shape:
            raise ValueError(f"inputs of shape {inputs.shape[1:]} per example; teachers expect {self.input_shape}")
        shared = ray.put(inputs)  # one copy in the object store, read by every actor
        partials = ray.get([actor.votes.remote(shared) for actor in self._actors])
        return np.sum(partials, axis=0, dtype=np.int64)

    def shutdown(self) -> None:
        """Stop the actors (their models and shards go with them)."""
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
