"""Teachers: models trained on disjoint private shards, packed several to a Ray actor.

One actor per teacher would start 250 processes on a 2-core machine, so each ``TeacherGroup``
trains several and votes for all of them at once. Each actor reads its own shards
(``TeacherSource``); only summed vote histograms leave it (with ``aggregation: secure``, only a
masked share). Teachers are checkpointed on their node, so a restarted actor reloads them; until
then the pool is not ready, and a histogram always counts every teacher.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import numpy as np
import ray
import torch
from tqdm import tqdm

from conclave.actors import run_folder
from conclave.actors.owners import GroupInfo, OwnerDataError, OwnerSource, describe_all, nodes_of
from conclave.actors.placement import require_node
from conclave.actors.vote_parties import VoteParties, VoteParty, party_blocks
from conclave.errors import InvalidValue
from conclave.learning.data import Dataset, make_splits, shard
from conclave.learning.data.dataset import SHARD_LEMMA
from conclave.learning.data.features import apply_features, features_of
from conclave.learning.data.schema import Standardiser
from conclave.learning.models import build_model
from conclave.learning.models.ensemble import StackedEnsemble
from conclave.learning.train_config import TrainConfig
from conclave.learning.training import fit, predict
from conclave.privacy.accounting.charge import Neighbouring
from conclave.progress import COUNTS

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
    records: ClassVar[None] = None  # no cap: a benchmark's private split is used whole

    def __post_init__(self) -> None:
        if self.num_teachers < 1:
            raise InvalidValue(f"num_teachers must be >= 1, got {self.num_teachers}")

    def load(self, teacher_ids: Sequence[int]) -> list[Dataset]:
        """The shards of the global teachers ``teacher_ids``, in that order."""
        if not teacher_ids or any(not 0 <= i < self.num_teachers for i in teacher_ids):
            raise InvalidValue(f"teacher ids must be a non-empty subset of [0, {self.num_teachers}), "
                             f"got {list(teacher_ids)}")
        splits = make_splits(self.dataset, self.root, public_size=self.public_size, seed=self.seed,
                             private_size=self.private_size)
        shards = shard(splits.private, self.num_teachers, self.seed)
        return [shards[i] for i in teacher_ids]

    @property
    def owner(self) -> str:
        return f"{self.dataset} (private split)"


class TeacherCheckpoints:
    """One group's trained teachers saved on its node, a file each named by its ensemble-wide index
    (``first_teacher`` + index in the group): written whole or not at all, read back by a restarted
    actor, deleted when the pool shuts down. No folder: nothing is saved.

    ``private_run`` (without ``folder``): keep them in that run's private folder on this node
    (``run_folder.claim``), which ``forget`` releases.
    """

    def __init__(self, folder: str | None, first_teacher: int, private_run: str | None) -> None:
        self.folder = folder
        self._first_teacher = first_teacher
        self._private_run = private_run if folder is None else None

    def claim(self) -> None:
        """Take the run's private folder, where there is one: before any model exists; it also clears
        what killed runs left on this node."""
        if self._private_run is not None:
            self.folder = str(run_folder.claim(self._private_run))

    def path(self, local_index: int) -> str | None:
        if self.folder is None:
            return None
        return os.path.join(self.folder, f"teacher-{self._first_teacher + local_index}.pt")

    def save(self, local_index: int, model: torch.nn.Module) -> None:
        path = self.path(local_index)
        if path is None:
            return
        os.makedirs(self.folder, mode=0o700, exist_ok=True)  # private models: owner only
        torch.save(model.state_dict(), path + ".partial")
        os.replace(path + ".partial", path)  # a crash mid-write leaves no half checkpoint

    def load(self, local_index: int, new_model: Callable[[int], torch.nn.Module]) -> torch.nn.Module | None:
        """The saved teacher ``local_index`` in a model from ``new_model``, or None where none was saved."""
        path = self.path(local_index)
        if path is None or not os.path.exists(path):
            return None
        model = new_model(local_index)
        model.load_state_dict(torch.load(path, weights_only=True))
        model.eval()
        return model

    def forget(self, count: int) -> None:
        """Delete the checkpoints of the group's ``count`` teachers, and the run's private folder
        once no other group holds it."""
        for i in range(count):
            path = self.path(i)
            if path is not None and os.path.exists(path):
                os.remove(path)
        if self._private_run is not None and self.folder is not None:
            run_folder.release(self.folder)
        elif self.folder is not None and os.path.isdir(self.folder) and not os.listdir(self.folder):
            shutil.rmtree(self.folder, ignore_errors=True)


def ensemble_predictor(models: list[torch.nn.Module]) -> Callable[[np.ndarray], np.ndarray]:
    """Every teacher's classes for a batch: stacked into one wide network where the
    architecture allows (``learning.models.ensemble``), else teacher by teacher."""
    stacked = StackedEnsemble.of(models)
    if stacked is not None:
        return stacked.predict
    return lambda inputs: np.stack([predict(model, inputs) for model in models])


class TeacherGroup(VoteParty):
    """Teachers ``first``..``last - 1`` of ``source`` in one process, on shards it loads
    itself from ``source`` — in an actor, the private data is read where it stays.

    No Ray here, so a benchmark can also run it in-process. Seeds and checkpoints follow the
    ensemble-wide index (``teacher_offset`` + index in the source), so the same teacher gets the
    same seed however the teachers are packed. A source that cannot be read is kept as an
    error that ``describe`` raises as ``OwnerDataError`` (one line, naming the owner).

    With ``source.features`` the shards are kept in that representation only, and ``votes``
    transforms its image inputs the same way before the teachers predict.

    ``checkpoint_dir`` and ``private_run``: where the teachers are saved (``TeacherCheckpoints``).
    """

    neighbouring, neighbouring_lemma = Neighbouring.ADD_REMOVE, SHARD_LEMMA  # one record moves at most one vote
    batch_coupled = False  # as a vote source in-process (``ready``): each teacher votes on each query alone
    local = False  # its votes are clean histograms (``actors.labeller.VoteSource.local``)
    sample_rate = votes_per_record = None  # no setting a mechanism is charged for (``actors.labeller.check_pairing``)

    def __init__(
        self,
        source: TeacherSource,
        first: int,
        last: int,
        model_name: str,
        train: TrainConfig,
        num_threads: int | None = None,
        checkpoint_dir: str | None = None,
        teacher_offset: int = 0,
        standardiser: Standardiser | None = None,
        private_run: str | None = None,
    ) -> None:
        if num_threads is not None:  # in an actor: as many threads as the CPUs it reserved
            torch.set_num_threads(max(1, num_threads))
        self.owner = source.owner
        self.features = source.features
        self.train_config = train
        self.first_teacher = teacher_offset + first
        self.model_name = model_name
        self.standardiser = standardiser
        self.checkpoints = TeacherCheckpoints(checkpoint_dir, self.first_teacher, private_run)
        self.load_error: str | None = None
        self._predict_all: Callable[[np.ndarray], np.ndarray] | None = None  # built at the first vote
        try:
            self.checkpoints.claim()
            raw = source.load(range(first, last))
        except (OSError, ValueError) as err:  # the owner's file: a missing path, a bad format; a folder not ours
            self.load_error = f"owner {self.owner}: {err}".splitlines()[0]
            self.shards, self.models, self.num_classes, self.input_shape = [], [], 0, ()
            return
        self.input_shape = raw[0].input_shape  # what queries look like, whatever the teachers learn on
        self.shards = [apply_features(shard, self.features) for shard in raw]
        self.num_classes = self.shards[0].num_classes
        self.models: list[torch.nn.Module | None] = [self.checkpoints.load(i, self._new_model)
                                                     for i in range(len(self.shards))]
        restored = sum(model is not None for model in self.models)
        if restored:
            log.info("teachers %d..%d: %d restored from %s", first, last - 1, restored, checkpoint_dir)

    def describe(self) -> GroupInfo:
        """Classes, input shape and node: what the pool checks queries against and records.
        Describes the data without revealing any of it; raises if the data could not be read."""
        if self.load_error is not None:
            raise OwnerDataError(self.load_error)
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        return GroupInfo(self.num_classes, self.input_shape, node)

    def train_teacher(self, local_index: int) -> None:
        """Train one teacher on its own shard (nothing about the training leaves the actor);
        a teacher already trained (or restored from its checkpoint) is left as it is.

        A shard the hash left empty keeps its initial weights: it still votes, and refusing
        it would depend on the private data."""
        if self.models[local_index] is not None:
            return
        shard = self.shards[local_index]
        seed = teacher_seed(self.train_config.seed, self.first_teacher + local_index)
        model = self._new_model(local_index)
        if len(shard):
            fit(model, shard, dataclasses.replace(self.train_config, seed=seed))
        model.eval()
        self.checkpoints.save(local_index, model)
        self.models[local_index] = model

    def _new_model(self, local_index: int) -> torch.nn.Module:
        seed = teacher_seed(self.train_config.seed, self.first_teacher + local_index)
        return build_model(self.model_name, self.num_classes, input_shape=self.shards[local_index].input_shape,
                           standardiser=self.standardiser, seed=seed)

    @ray.method(concurrency_group="probe")
    def is_trained(self) -> bool:
        """Whether every teacher here can vote. In the actor it runs in its own thread, so the
        aggregator's health probe is answered while a long vote is under way."""
        return self.load_error is None and all(model is not None for model in self.models)

    def ready(self, timeout: float = 2.0) -> bool:
        """Health when the group itself is the vote source (in-process, e.g. a benchmark): trained."""
        return self.is_trained()

    @property
    def votes_per_query(self) -> int:
        """As a vote source in-process: every teacher of the group votes once on every query."""
        return len(self.models)

    def forget(self) -> None:
        """Delete this group's checkpoints: the pool is shutting down (``TeacherCheckpoints.forget``)."""
        self.checkpoints.forget(len(self.models))

    def train_all(self) -> None:
        for i in range(len(self.models)):
            self.train_teacher(i)

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        """Histogram ``int64[batch, k]`` of this group's teachers' predicted classes for images
        ``inputs`` (in the teachers' representation first, when they learn on features)."""
        if self.load_error is not None or not self.is_trained():
            raise RuntimeError("teachers must be trained before they vote")
        inputs = features_of(inputs, self.features)
        if self._predict_all is None:  # once: every teacher is trained now, and none changes afterwards
            self._predict_all = ensemble_predictor(self.models)
        predicted = self._predict_all(inputs)  # int64 [teachers, batch]
        cells = np.arange(len(inputs)) * self.num_classes + predicted  # (input, class) of every vote
        return np.bincount(cells.ravel(), minlength=len(inputs) * self.num_classes).reshape(len(inputs), -1)

    def partial_votes(self, queries: np.ndarray, stream: str) -> np.ndarray:
        """What this group sends the vote source: its teachers' histogram (nothing random)."""
        return self.votes(queries)


# The Ray actor is the same class; Ray imports it by module path in the worker. A dead actor
# is restarted (its constructor reloads the saved teachers); calls to it are not retried, so
# a vote fails at once and the aggregator turns NOT_SERVING rather than waiting. Training and
# voting run one at a time; only the health probe has a thread of its own.
TeacherGroupActor = ray.remote(max_restarts=3, max_task_retries=0, concurrency_groups={"probe": 1})(TeacherGroup)


@dataclass(frozen=True)
class OwnerShare:
    """One owner's part of an ensemble: its source, how many teachers (the first
    ``num_teachers`` of the source's shards), on how many actors."""

    source: TeacherSource | OwnerSource
    num_teachers: int
    num_actors: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.num_teachers <= self.source.num_teachers:
            raise InvalidValue(f"num_teachers must be in [1, {self.source.num_teachers}], got {self.num_teachers}")
        if self.num_actors < 1:
            raise InvalidValue(f"num_actors must be >= 1, got {self.num_actors}")


class TeacherPool(VoteParties):
    """Driver-side handle over the teacher actors of one or more owners; the vote source of
    the aggregator.

    It holds actor handles, the teachers' packing, the shape of their inputs and the node each
    owner's actors run on — never their data: each actor loads its own shards from its owner's
    source, where Ray places it. ``neighbouring`` and ``neighbouring_lemma`` say
    which record-level relation the vote mechanisms' one-vote charges hold for over this
    ensemble (each record is one owner's, in one shard: one vote).

    Args:
        shares: each owner's source, teacher count and actor count.
        model_name: a ``learning.models.build_model`` name (or ``module:function``).
        train: training settings; ``train.seed`` is the base of every teacher's seed.
        seed: base seed (replaces ``train.seed`` when given, so one config seed drives a run).
        num_cpus_per_actor: CPUs each actor reserves; also its torch thread count (≥ 1).
        num_gpus: GPU fraction per actor; ``None`` detects: a share of the cluster's GPUs
            when it has any, else 0 (a CPU-only cluster never waits on a GPU request).
        checkpoint_dir: where each actor saves its trained teachers, on its own node
            (default: this run's private folder under each node's temp dir, ``actors.run_folder``,
            removed by ``shutdown``, or by the next start on the node if the run was killed).
        standardiser: public column statistics for table models.
    """

    neighbouring, neighbouring_lemma = Neighbouring.ADD_REMOVE, SHARD_LEMMA
    # Deadlines (``VoteParties``): a vote call 15 s, three times the largest batch's vote (250 MNIST
    # teachers label about 220 inputs/s: 1,024 inputs in about 5 s); a secure round 12 s, about one
    # vote of the batch plus the masks. Both below the client's 30 s deadline.
    actor_kind, restart_note = "teacher actor", " from its saved teachers"
    batch_coupled = False  # each teacher votes on each query alone

    def __init__(
        self,
        shares: Sequence[OwnerShare],
        model_name: str,
        train: TrainConfig,
        seed: int | None = None,
        num_cpus_per_actor: float = 1.0,
        num_gpus: float | None = None,
        checkpoint_dir: str | None = None,
        standardiser: Standardiser | None = None,
    ) -> None:
        if not shares:
            raise InvalidValue("an ensemble needs at least one owner")
        if seed is not None:
            train = dataclasses.replace(train, seed=seed)
        self.num_teachers = sum(share.num_teachers for share in shares)
        total_actors = sum(min(share.num_actors, share.num_teachers) for share in shares)
        if num_gpus is None:
            num_gpus = gpu_share(float(ray.cluster_resources().get("GPU", 0.0)), total_actors)
        threads = max(1, math.floor(num_cpus_per_actor))
        self.private_run = None if checkpoint_dir else uuid.uuid4().hex
        # Where the checkpoints are (for messages): on a node other than this one, under its temp dir.
        self.checkpoint_dir = checkpoint_dir or str(run_folder.base_folder() / self.private_run)
        plans = []
        for share in shares:  # every request checked before any actor starts
            num_actors = min(share.num_actors, share.num_teachers)
            # A request no node can take would queue forever: one line naming it instead.
            require_node(f"owner {share.source.owner}'s teachers", num_cpus_per_actor, num_gpus)
            plans.append((share, num_actors))
        spawns, self._blocks, owners = [], [], []
        offset = 0
        for share, num_actors in plans:
            for a, b in party_blocks(share.num_teachers, num_actors):  # contiguous blocks of teachers
                # How to start this actor again once Ray has given up restarting it.
                spawns.append(functools.partial(
                    TeacherGroupActor.options(num_cpus=num_cpus_per_actor, num_gpus=num_gpus).remote,
                    share.source, a, b, model_name, train, num_threads=threads,
                    checkpoint_dir=checkpoint_dir or None, teacher_offset=offset, standardiser=standardiser,
                    private_run=self.private_run))
                self._blocks.append((a, b))
                owners.append(share.source.owner)
            offset += share.num_teachers
        self._track(spawns, owners, num_cpus_per_actor)
        # Waits until every actor has loaded its shards (a missing data file fails here, not
        # mid-training), learns the input shape queries must have and where each owner runs.
        described = describe_all(self.roster.actors, self.roster.owners, self.shutdown)
        self.num_classes, self.input_shape = described[0].num_classes, described[0].input_shape
        self.placement = nodes_of(self.roster.owners, described)
        log.info("%d teachers of %d owner(s) on %d actors (%s CPU, %s GPU each)", self.num_teachers,
                 len(shares), len(self.roster.actors), num_cpus_per_actor, num_gpus)

    @classmethod
    def of_source(cls, source: TeacherSource | OwnerSource, num_teachers: int, model_name: str,
                  train: TrainConfig, num_actors: int, **kwargs) -> TeacherPool:
        """The first ``num_teachers`` teachers of one source on ``num_actors`` actors (capped at
        the number of teachers) anywhere in the cluster."""
        return cls([OwnerShare(source, num_teachers, num_actors)], model_name, train, **kwargs)

    def train(self, progress: bool = True, retries: int = 2) -> None:
        """Train every teacher (actors in parallel). A teacher whose actor died is asked
        again of the restarted actor (which keeps what it saved) up to ``retries`` times."""
        tasks = {actor.train_teacher.remote(local): (actor, local, 0)
                 for actor, (first, last) in zip(self.roster.actors, self._blocks) for local in range(last - first)}
        with tqdm(total=self.num_teachers, desc="training teachers", unit="teachers", bar_format=COUNTS,
                  disable=not progress) as bar:
            while tasks:
                [done], _ = ray.wait(list(tasks), num_returns=1)
                actor, local, attempt = tasks.pop(done)
                try:
                    ray.get(done)  # raises here if that teacher failed
                except ray.exceptions.RayActorError:
                    if attempt >= retries:
                        raise
                    log.warning("a teacher actor died while training; asking its restarted actor again")
                    tasks[actor.train_teacher.remote(local)] = (actor, local, attempt + 1)
                    continue
                bar.update(1)

    @property
    def votes_per_query(self) -> int:
        """Every teacher votes once on every query."""
        return self.num_teachers

    def _probe(self, actor: ray.actor.ActorHandle) -> ray.ObjectRef:
        return actor.is_trained.remote()

    def queries(self, inputs: np.ndarray) -> np.ndarray:
        return inputs  # teachers vote on the inputs themselves (each group transforms them as it learned)

    def cell_bounds(self) -> list[int]:
        return [last - first for first, last in self._blocks]  # one vote per teacher and query

    def shutdown(self) -> None:
        """Stop the actors (their models and shards go with them, their checkpoints are deleted)."""
        try:
            ray.get([actor.forget.remote() for actor in self.roster.actors], timeout=30)
        except ray.exceptions.RayError as err:  # includes GetTimeoutError
            log.warning("teacher checkpoints under %s may remain: %s", self.checkpoint_dir, type(err).__name__)
        self.stop()
