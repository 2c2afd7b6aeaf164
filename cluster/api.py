"""The library API: owners' data → a teacher ensemble → a private aggregator → a student.

    from conclave.cluster.api import Config, DataSource, OwnerConfig, serve, train_ensemble, train_student

    config = Config(
        name="hospitals",
        owners=(OwnerConfig("hospital_a", DataSource("csv", "/data/a.csv", label="diagnosis"),
                            teachers=10, resources={"hospital_a": 1}), ...),
        public=DataSource("csv", "pool.csv"), test=DataSource("csv", "test.csv", label="diagnosis"))
    with train_ensemble(config) as ensemble:                          # teachers, on their owners' nodes
        with serve(config, ensemble, "ledger.sqlite") as aggregator:  # gRPC on 127.0.0.1, ledger-gated
            student = train_student(config, ensemble, aggregator)     # StudentResult
            report = aggregator.privacy_report()                      # the guarantee first

Each step returns a typed result; ``conclave run`` (``cluster.pipelines.teacher_student``),
``conclave serve``, the tuning trainables and the benchmarks are clients of these functions.
``examples/hospitals/library.py`` is the runnable version of the lines above.
"""
from __future__ import annotations

import functools
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conclave.cluster.owners import owner_resources
from conclave.cluster.pipelines import PrivacyConfig
from conclave.cluster.pipelines.teacher_student import (
    Config, Ensemble, MechanismConfig, OwnerConfig, PublicData, StudentConfig, TeachersConfig, TrainingConfig,
    checked_public, privacy_section, reserve_estimates, resolved, server_settings,
    start_aggregator, train_teachers,
)
from conclave.learning.data.sources import DataSource

log = logging.getLogger(__name__)

STUDENT_START_TIMEOUT = 60.0  # seconds a student actor may wait for a CPU before the run fails
MIN_STUDENT_CPUS = 0.1  # less than this free on every node: fail now rather than crawl


def train_ensemble(config: Config, ray_address: str | None = None, progress: bool = True,
                   public: PublicData | None = None) -> Ensemble:
    """Check what the driver can (``ConfigError``), start or join Ray, and train every owner's
    teachers on its own node. Use as a context manager (or call ``shutdown``). ``public``: the
    driver's data when already loaded and checked (``checked_public``)."""
    public = public if public is not None else checked_public(config)
    config = resolved(config, public)
    from conclave.cluster.ray_runtime import start_ray

    embedded = start_ray(ray_address, resources=owner_resources(config.owners), runtime_env=config.runtime_env,
                         models=config.models)
    return train_teachers(config, progress=progress, public=public, embedded=embedded)


@dataclass
class Aggregator:
    """A running gRPC aggregator over an ensemble, and the ledger every answer is charged to."""

    config: Config
    server: Any  # actors.aggregator.AggregatorServer
    ledger: Any  # privacy.accounting.ledger.PrivacyLedger
    address: str  # host:port
    token: str  # the bearer token clients send
    _running: bool = field(default=True, repr=False)

    def budget(self):
        """The budget reply clients get (``actors.labeller.BudgetStatus``)."""
        return self.server.budget()

    def privacy_report(self) -> dict[str, Any]:
        """What the run may publish: the guarantee, the spend, and labelled estimates."""
        if self.config.secure:  # the aggregator never saw a clean vote: nothing to estimate from
            return privacy_section(self.config, self.ledger, None, None)
        votes, answered = self.server.answered_votes()
        return privacy_section(self.config, self.ledger, votes, answered)

    def stop(self) -> None:
        """Stop serving (the ledger stays open for ``privacy_report``)."""
        if self._running:
            self.server.stop()
            self._running = False

    def close(self) -> None:
        self.stop()
        self.ledger.close()

    def __enter__(self) -> Aggregator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(config: Config, ensemble: Ensemble, ledger_path: str | Path, token: str | None = None,
          fresh: bool = True, **server: Any) -> Aggregator:
    """Serve ``ensemble`` with ``config``'s mechanism, every answer charged to the ledger at
    ``ledger_path`` (``fresh``: start it empty, as a run does; else keep what it holds, as a
    service does). ``server``: ``ServerSettings`` fields to override (host, port, TLS...)."""
    config = resolved(config, ensemble.public)
    ledger_path = Path(ledger_path)
    if fresh:
        for stale in ledger_path.parent.glob(ledger_path.name + "*"):
            stale.unlink()
    ledger_path.parent.mkdir(parents=True, exist_ok=True)
    ledger = config.privacy.open_ledger(ledger_path, config.planned())
    reserve_estimates(config, ledger)
    token = token or secrets.token_urlsafe(24)
    try:
        aggregator, address = start_aggregator(config, ensemble.pool, ledger, server_settings(config, token, **server))
    except BaseException:
        ledger.close()
        raise
    log.info("aggregator serving on %s", address)
    return Aggregator(config, aggregator, ledger, address, token)


@dataclass(frozen=True)
class StudentResult:
    """What the student learned: accuracy on the test split after all its answers, and the
    curve at each checkpoint (with the ledger's realised spend then)."""

    accuracy: float
    label_accuracy: float | None  # released labels against the pool's truth (None: the pool has no labels)
    asked: int
    answered: int
    budget_exhausted: bool
    labels_per_second: float
    curve: list[dict[str, Any]]
    query_seconds: float
    train_seconds: float


def train_student(config: Config, ensemble: Ensemble, aggregator: Aggregator, progress: bool = True) -> StudentResult:
    """A student actor asks ``aggregator`` over gRPC, like any outside client, about the public
    pool, then trains on the answers (and the pool, as configured) and is tested."""
    import ray

    from conclave.actors.placement import PlacementError, largest_free_cpu, require_node
    from conclave.actors.student import StudentActor
    from conclave.cluster.client import AggregatorClient

    config = resolved(config, ensemble.public)
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    free = largest_free_cpu()
    # On small nodes the student takes what one node has free (it trains a small model).
    student_cpus = min(1.0, cpus / 2) if free is None else min(1.0, cpus / 2, free)
    if free is not None and student_cpus < MIN_STUDENT_CPUS:
        raise PlacementError(f"the student: no node has {MIN_STUDENT_CPUS:g} CPU free (the most on one node: "
                             f"{free:g}); give the cluster a node with a free CPU")
    require_node("the student", cpus=student_cpus)
    student = StudentActor.options(num_cpus=student_cpus).remote(
        ensemble.splits.public, ensemble.splits.test, config.student.model, config.student.train.with_seed(config.seed),
        # A teacher actor restarting makes the aggregator UNAVAILABLE for seconds: wait, nothing was charged.
        functools.partial(AggregatorClient, aggregator.address, aggregator.token, retry_unavailable=300.0),
        num_threads=max(1, int(student_cpus)), features=config.data.features,
        pseudo_label_threshold=config.student.pseudo_label_threshold,
        semi_supervised=config.student.semi_supervised, selection=config.student.selection,
        standardiser=ensemble.public.standardiser,
    )
    try:
        try:  # a CPU some node has but none has free (the teachers hold them) would wait forever
            ray.get(student.__ray_ready__.remote(), timeout=STUDENT_START_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            raise PlacementError(f"the student: no node had {student_cpus:g} CPU free within "
                                 f"{STUDENT_START_TIMEOUT:g} s (free: {ray.available_resources().get('CPU', 0):g} "
                                 "CPU in all); give the cluster a node with a free CPU") from None
        queried = _query(student, config.student, progress)
        started = time.perf_counter()
        curve = ray.get(student.learning_curve.remote())
        train_seconds = time.perf_counter() - started
    finally:
        ray.kill(student)  # frees its CPU now, not whenever the handle is collected
    label_accuracy = queried["label_accuracy"]
    return StudentResult(
        accuracy=curve[-1]["accuracy"], asked=queried["asked"], answered=queried["answered"],
        label_accuracy=None if label_accuracy is None or math.isnan(label_accuracy) else label_accuracy,
        budget_exhausted=queried["budget_exhausted"], labels_per_second=queried["labels_per_second"],
        curve=curve, query_seconds=queried["query_seconds"], train_seconds=train_seconds)


def _query(student, settings: StudentConfig, progress: bool, batches_per_call: int = 4) -> dict[str, Any]:
    """Let the student actor query in short stretches so the driver can show a progress bar."""
    import ray
    from tqdm import tqdm

    with tqdm(total=settings.queries, desc="student queries", unit="query", disable=not progress) as bar:
        while True:
            state = ray.get(student.query.remote(settings.queries, settings.batch_size, settings.checkpoints,
                                                 progress=False, max_batches=batches_per_call))
            bar.update(state["asked"] - bar.n)
            if state["asked"] >= settings.queries or state["budget_exhausted"]:
                break
    ray.get(student.close.remote())
    return state


__all__ = [
    "Aggregator", "Config", "DataSource", "Ensemble", "MechanismConfig", "OwnerConfig", "PrivacyConfig",
    "StudentConfig", "StudentResult", "TeachersConfig", "TrainingConfig", "serve", "train_ensemble", "train_student",
]
