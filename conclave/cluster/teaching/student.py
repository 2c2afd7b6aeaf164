"""A student actor that asks the aggregator over gRPC, like any outside client, then learns
from the answers (and the public pool, as configured) and is tested."""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from conclave.cluster.owners import PublicData
from conclave.cluster.teaching.aggregation import Aggregator
from conclave.cluster.teaching.config import TeacherStudentConfig, StudentConfig
from conclave.cluster.teaching.ensemble import Ensemble, public_data, resolved
from conclave.errors import InvalidValue

if TYPE_CHECKING:
    from conclave.learning.embeddings import Embedding, NetworkEmbedding

log = logging.getLogger(__name__)

STUDENT_START_TIMEOUT = 180.0  # seconds a student may wait for a CPU (a loaded machine frees them slowly) before the run fails
MIN_STUDENT_CPUS = 0.1  # less than this free on every node: fail now rather than crawl


@dataclass(frozen=True)
class StudentResult:
    """What the student learned: accuracy on the test split after all its answers, and the
    curve at each checkpoint (with the ledger's realised spend then)."""

    accuracy: float
    label_accuracy: float | None  # released labels against the pool's truth (None: the pool has no labels)
    asked: int
    answered: int
    budget_exhausted: bool
    curve: list[dict[str, Any]]  # each checkpoint's student: trained on released labels and public inputs
    network: NetworkEmbedding | None = None  # the final model, a free embedding for a later round (image inputs)


def train_student(config: TeacherStudentConfig, ensemble: Ensemble, aggregator: Aggregator,
                  progress: bool = True) -> StudentResult:
    """A student actor asks ``aggregator`` over gRPC, like any outside client, about the public
    pool, then trains on the answers (and the pool, as configured) and is tested."""
    import ray

    from conclave.actors.placement import PlacementError, cpu_share, largest_free, release, require_node
    from conclave.actors.student import StudentActor
    from conclave.cluster.client import AggregatorClient
    from conclave.cluster.ray_runtime import gpus_available

    config = resolved(config, ensemble.public)
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    free = largest_free()
    # On small nodes the student takes what one node has free (it trains a small model).
    student_cpus = cpu_share(min(1.0, cpus / 2) if free is None else min(1.0, cpus / 2, free), 1)
    if free is not None and student_cpus < MIN_STUDENT_CPUS:
        raise PlacementError(f"the student: no node has {MIN_STUDENT_CPUS:g} CPU free (the most on one node: "
                             f"{free:g}); give the cluster a node with a free CPU")
    # A GPU share where one is free (teachers may hold every GPU): its FixMatch and its features run there.
    student_gpus = min(1.0, largest_free("GPU") or 0.0) if gpus_available() > 0 else 0.0
    if gpus_available() > 0 and not student_gpus:
        log.info("the student trains on CPUs: no GPU is free (the teachers hold them)")
    require_node("the student", cpus=student_cpus, gpus=student_gpus)
    student = _new_student(
        StudentActor.options(num_cpus=student_cpus, num_gpus=student_gpus).remote, config, ensemble.public,
        # A teacher actor restarting makes the aggregator UNAVAILABLE for seconds: wait, nothing was charged.
        functools.partial(AggregatorClient, aggregator.address, aggregator.token, retry_unavailable=300.0),
        num_threads=max(1, int(student_cpus)),
        cluster_embedding=config.vote_source.student_embedding(ensemble.pool))
    try:
        try:  # a CPU some node has but none has free (the teachers hold them) would wait forever
            ray.get(student.__ray_ready__.remote(), timeout=STUDENT_START_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            raise PlacementError(f"the student: no node had {student_cpus:g} CPU free within "
                                 f"{STUDENT_START_TIMEOUT:g} s (free: {ray.available_resources().get('CPU', 0):g} "
                                 "CPU in all); give the cluster a node with a free CPU") from None
        queried = _query(student, config.student, progress)
        curve = ray.get(student.learning_curve.remote())
        network = ray.get(student.network.remote())
    finally:
        release([student], student_cpus)  # its CPU is free before the next run asks, not whenever Ray gets to it
    label_accuracy = queried["label_accuracy"]
    return StudentResult(
        accuracy=curve[-1]["accuracy"], asked=queried["asked"], answered=queried["answered"],
        label_accuracy=None if label_accuracy is None or math.isnan(label_accuracy) else label_accuracy,
        budget_exhausted=queried["budget_exhausted"], curve=curve, network=network)


@dataclass(frozen=True)
class Ceiling:
    """NON-PRIVATE REFERENCE: a config's student trained on every pool input's true label."""

    model: str
    labelled: int
    accuracy: float
    # Each member's own accuracy, where the student averages several (``student.members``): the
    # spread over seeds that one private run's single draw sits in.
    member_accuracies: tuple[float, ...] = ()
    note: str = "non-private: trained on the pool's true labels, no ε"


def non_private_ceiling(config: TeacherStudentConfig, progress: bool = True) -> Ceiling:
    """What a private student could at best reach with this model and pool: ``config``'s student,
    trained exactly as its runs train it (its ``StudentTrainer``), on all the pool's true labels.

    Reads the public pool's labels only (no private record, no mechanism): it is no private
    release, and no private result either; publish it as a ceiling, without an ε."""
    from conclave.learning.models import model_label
    from conclave.learning.models.averaged import AveragedStudents
    from conclave.learning.student_training import StudentTrainer

    public = public_data(config)
    pool = public.splits.public
    if pool.unlabeled:
        raise InvalidValue("the non-private ceiling needs a pool with labels")
    config = resolved(config, public)
    trainer = StudentTrainer(public.splits.public, public.splits.test, config.student.model,
                             **_training(config, public))
    model, _ = trainer.train_on(np.arange(len(pool)), pool.y, progress)
    averaged = isinstance(model, AveragedStudents)
    members = tuple(trainer.accuracy(member) for member in model.members) if averaged else ()
    return Ceiling(model=model_label(trainer.model_name), labelled=len(pool), accuracy=trainer.accuracy(model),
                   member_accuracies=members)


def _new_student(construct: Callable[..., Any], config: TeacherStudentConfig, public: PublicData,
                 client_factory: Callable[[], Any], num_threads: int | None = None,
                 cluster_embedding: Embedding | None = None) -> Any:
    """``construct`` (a Ray actor's ``remote`` of ``Student``) with ``config``'s student settings."""
    from conclave.learning.student_training import StudentTrainer

    trainer = StudentTrainer(public.splits.public, public.splits.test, config.student.model, **_training(config, public))
    return construct(public.splits.public, trainer, client_factory, num_threads=num_threads,
                     selection=config.student.selection, cluster_embedding=cluster_embedding)


def _training(config: TeacherStudentConfig, public: PublicData) -> dict[str, Any]:
    """How ``config``'s student learns from its answers: ``StudentTrainer``'s settings but the data and model."""
    student = config.student
    return {"train": dataclasses.replace(student.train, seed=config.seed), "features": config.data.features,
            "pseudo_label_threshold": student.pseudo_label_threshold, "semi_supervised": student.semi_supervised,
            "standardiser": public.standardiser, "label_propagation": student.label_propagation,
            "members": student.members, "test_views": student.test_views}


def _query(student, settings: StudentConfig, progress: bool, batches_per_call: int = 4) -> dict[str, Any]:
    """Let the student actor query in short stretches so the driver can show a progress bar."""
    import ray
    from tqdm import tqdm

    from conclave.progress import COUNTS

    with tqdm(total=settings.queries, desc="student queries", unit="queries", bar_format=COUNTS,
              disable=not progress) as bar:
        while True:
            state = ray.get(student.query.remote(settings.queries, settings.batch_size, settings.checkpoints,
                                                 progress=False, max_batches=batches_per_call))
            bar.update(state["asked"] - bar.n)
            if state["asked"] >= settings.queries or state["budget_exhausted"]:
                break
    ray.get(student.close.remote())
    return state
