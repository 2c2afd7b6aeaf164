"""Teachers: models trained on disjoint private shards, packed several to a Ray actor.

PATE at the papers' scale has 250 teachers; one actor per teacher would start 250 Python
processes on a 2-core machine. Instead each actor (a ``TeacherGroup``) holds the shards of
several teachers, trains them one after another, and answers vote requests for all of
them at once. The actors train in parallel with each other.

The driver never holds private shards: it hands each actor a ``TeacherSource`` (dataset name,
root, split sizes, seed) and the block of teachers it keeps, and the actor reads its own
shards from it in its own process — the counterpart of ``actors.dp_trainer.PrivateSource``.
With ``TeacherSource.features`` (e.g. scattering, see ``learning.data.features``) the teachers
learn on a fixed representation that each actor computes from its own images, and transform
every query the same way: the pool takes images and the aggregator still validates images.

What leaves an actor: a vote histogram ``int[batch, k]`` summed over its teachers (the
driver adds the actors' partial histograms, which only the aggregator's DP mechanism reads),
and once the number of classes and the input shape. Per-teacher predictions, losses, models
and data stay inside the actor.

Shards are cut by a keyed hash of each record (``learning.data.shard``), so adding or
removing one record changes one teacher's shard and at most one vote: the vote mechanisms'
one-vote bounds hold for add/remove neighbours of the owners' data (``SHARD_LEMMA``).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import ray
import torch
from tqdm import tqdm

from learning.data import Dataset, make_splits, shard
from learning.data.dataset import SHARD_LEMMA
from learning.data.features import apply_features, features_of
from learning.models import build_model
from learning.training import TrainConfig, fit, predict
from privacy.accounting.charge import ADD_REMOVE

log = logging.getLogger(__name__)


def teacher_seed(base_seed: int, teacher: int) -> int:
    """Seed of one teacher's initialisation and batch order: distinct per teacher, repeatable."""
    return base_seed * 100_003 + teacher


def gpu_share(cluster_gpus: float, num_actors: int) -> float:
    """GPUs each actor asks for: an equal share (at most one each), or 0 without GPUs."""
    return min(1.0, cluster_gpus / num_actors) if cluster_gpus > 0 else 0.0


@dataclass(frozen=True)
class TeacherSource:
    """Where the teachers' private shards come from, as a spec the driver can pass around.

    The shards are ``make_splits``'s private split of ``dataset`` cut by ``shard`` into
    ``num_teachers`` disjoint shards, all with ``seed`` — the same shards a driver would get
    from ``shard(make_splits(...).private, num_teachers, seed)``. ``public_size`` belongs to
    the spec because ``make_splits`` draws the ``private_size`` subsample after the public
    shuffle. Only ``TeacherGroup`` calls ``load``, in the process that keeps the shards, and
    computes their ``features`` there (None: the teachers learn on the images).
    """

    dataset: str
    root: str | None
    public_size: int
    num_teachers: int
    seed: int = 0
    private_size: int | None = None
    features: str | None = None

    def __post_init__(self) -> None:
        if self.num_teachers < 1:
            raise ValueError(f"num_teachers must be >= 1, got {self.num_teachers}")

    def load(self, teacher_ids: Sequence[int]) -> list[Dataset]:
        """The shards of the global teachers ``teacher_ids``, in that order."""
        if not teacher_ids or any(not 0 <= i < self.num_teachers for i in teacher_ids):
            raise ValueError(f"teacher ids must be a non-empty subset of [0, {self.num_teachers}), "
                             f"got {list(teacher_ids)}")
        splits = make_splits(self.dataset, self.root, public_size=self.public_size, seed=self.seed,
                             private_size=self.private_size)
        shards = shard(splits.private, self.num_teachers, self.seed)
        return [shards[i] for i in teacher_ids]


class TeacherGroup:
    """Teachers ``first``..``last - 1`` (global indices) in one process, on shards it loads
    itself from ``source`` — in an actor, the private data is read where it stays.

    No Ray here, so a benchmark can also run it in-process. Seeds follow global indices, so
    the same teacher gets the same seed however the teachers are packed.

    With ``source.features`` the shards are kept in that representation only, and ``votes``
    transforms its image inputs the same way before the teachers predict.
    """

    neighbouring, neighbouring_lemma = ADD_REMOVE, SHARD_LEMMA  # one record moves at most one vote

    def __init__(
        self,
        source: TeacherSource,
        first: int,
        last: int,
        model_name: str,
        train: TrainConfig,
        num_threads: int | None = None,
    ) -> None:
        if num_threads is not None:  # in an actor: as many threads as the CPUs it reserved
            torch.set_num_threads(max(1, num_threads))
        images = source.load(range(first, last))
        self.input_shape = images[0].input_shape  # queries are images, whatever the teachers learn on
        self.features = source.features
        self.shards = [apply_features(shard, self.features) for shard in images]
        self.train_config = train
        self.first_teacher = first
        self.model_name = model_name
        self.num_classes = self.shards[0].num_classes
        self.models: list[torch.nn.Module | None] = [None] * len(self.shards)

    def data_shape(self) -> tuple[int, tuple[int, ...]]:
        """(number of classes, shape of one input image): what the pool checks queries against.
        Describes the data without revealing any of it."""
        return self.num_classes, self.input_shape

    def train_teacher(self, local_index: int) -> None:
        """Train one teacher on its own shard (nothing about the training leaves the actor).

        A shard the hash left empty keeps its initial weights: it still votes, and refusing
        it would depend on the private data."""
        shard = self.shards[local_index]
        seed = teacher_seed(self.train_config.seed, self.first_teacher + local_index)
        _, channels, _, side = shard.x.shape
        model = build_model(self.model_name, self.num_classes, in_channels=int(channels), seed=seed,
                            input_size=int(side))
        if len(shard):
            fit(model, shard, dataclasses.replace(self.train_config, seed=seed))
        model.eval()
        self.models[local_index] = model

    def train_all(self) -> None:
        for i in range(len(self.models)):
            self.train_teacher(i)

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        """Histogram ``int64[batch, k]`` of this group's teachers' predicted classes for images
        ``inputs`` (in the teachers' representation first, when they learn on features)."""
        if any(model is None for model in self.models):
            raise RuntimeError("teachers must be trained before they vote")
        inputs = features_of(inputs, self.features)
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

    It holds actor handles, the teachers' packing and the shape of their inputs — never
    their data: each actor loads its own shards from ``source``. ``neighbouring`` and
    ``neighbouring_lemma`` say which record-level relation the vote mechanisms' one-vote
    charges hold for over this ensemble.

    Args:
        source: where the teachers' shards come from.
        num_teachers: how many teachers to train, on the first ``num_teachers`` of
            ``source``'s shards (all of them in a run; fewer in the benchmark's comparison).
        model_name: a ``learning.models.build_model`` name.
        train: training settings; ``train.seed`` is the base of every teacher's seed.
        num_actors: how many Ray actors share the teachers (capped at the number of teachers).
        seed: base seed (replaces ``train.seed`` when given, so one config seed drives a run).
        num_cpus_per_actor: CPUs each actor reserves; also its torch thread count (≥ 1).
        num_gpus: GPU fraction per actor; ``None`` detects: a share of the cluster's GPUs
            when it has any, else 0 (a CPU-only cluster never waits on a GPU request).
    """

    neighbouring, neighbouring_lemma = ADD_REMOVE, SHARD_LEMMA

    def __init__(
        self,
        source: TeacherSource,
        num_teachers: int,
        model_name: str,
        train: TrainConfig,
        num_actors: int,
        seed: int | None = None,
        num_cpus_per_actor: float = 1.0,
        num_gpus: float | None = None,
    ) -> None:
        if not 1 <= num_teachers <= source.num_teachers:
            raise ValueError(f"num_teachers must be in [1, {source.num_teachers}], got {num_teachers}")
        if num_actors < 1:
            raise ValueError(f"num_actors must be >= 1, got {num_actors}")
        if seed is not None:
            train = dataclasses.replace(train, seed=seed)
        self.num_teachers = num_teachers
        num_actors = min(num_actors, self.num_teachers)
        if num_gpus is None:
            num_gpus = gpu_share(float(ray.cluster_resources().get("GPU", 0.0)), num_actors)
        # Contiguous blocks of teachers per actor, sizes differing by at most one.
        bounds = np.linspace(0, self.num_teachers, num_actors + 1).round().astype(int)
        self._blocks = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        threads = max(1, math.floor(num_cpus_per_actor))
        self._actors = [
            TeacherGroupActor.options(num_cpus=num_cpus_per_actor, num_gpus=num_gpus).remote(
                source, a, b, model_name, train, num_threads=threads
            )
            for a, b in self._blocks
        ]
        # Waits until every actor has loaded its shards (a missing data file fails here, not
        # mid-training) and learns the input shape queries must have.
        try:
            described = ray.get([actor.data_shape.remote() for actor in self._actors])
        except Exception:
            self.shutdown()  # the actors that did start would otherwise hold their CPUs
            raise
        self.num_classes, self.input_shape = described[0]  # one dataset: the same for every actor
        log.info(
            "%d teachers on %d actors (%s CPU, %s GPU each)",
            self.num_teachers, len(self._actors), num_cpus_per_actor, num_gpus,
        )

    @property
    def num_actors(self) -> int:
        return len(self._actors)

    def train(self, progress: bool = True) -> None:
        """Train every teacher (actors in parallel)."""
        started = time.perf_counter()
        remaining = [actor.train_teacher.remote(local)
                     for actor, (first, last) in zip(self._actors, self._blocks) for local in range(last - first)]
        with tqdm(total=self.num_teachers, desc="training teachers", unit="teacher", disable=not progress) as bar:
            while remaining:
                done, remaining = ray.wait(remaining, num_returns=1)
                ray.get(done[0])  # raises here if that teacher failed
                bar.update(1)
        log.info("trained %d teachers in %.1f s", self.num_teachers, time.perf_counter() - started)

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
