"""What votes, started: teachers on Ray actors, or the owners behind their gateways; and the driver's public data.

``train_ensemble`` checks what the driver can before Ray starts, starts or joins Ray, then trains
the benchmark's teachers (or starts the actors whose records vote) or, with owners, admits the run
at every owner's gateway: their own, or those it starts on this machine for owners named by their
data (``cluster.gateway.local``). Owners' teachers train behind their gateways; the private data
never reaches the driver.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from conclave.cluster.owners import PublicData, check_owner_columns
from conclave.cluster.teaching.config import DEFAULT_STUDENT, DEFAULT_TABLE_STUDENT, TeacherStudentConfig
from conclave.errors import InvalidValue
from conclave.learning.data.dataset import StudentSplits
from conclave.progress import waiting

if TYPE_CHECKING:  # imported where used: loading a config needs neither torch nor Ray
    from conclave.actors.cluster_votes import ClusterVoteSource
    from conclave.actors.knn_votes import KnnVoteSource
    from conclave.actors.teacher import OwnerShare, TeacherPool, TeacherSource
    from conclave.cluster.gateway.client import GatewayVoteSource
    from conclave.cluster.gateway.local import LocalGateways
    from conclave.cluster.run_privacy import GatewayAccount


def train_ensemble(config: TeacherStudentConfig, ray_address: str | None = None, progress: bool = True,
                   public: PublicData | None = None) -> Ensemble:
    """Check what the driver can (``ConfigError``), start or join Ray, and train every owner's
    teachers on its own node. Use as a context manager (or call ``shutdown``). ``public``: the
    driver's data when already loaded and checked (``checked_public``)."""
    public = public if public is not None else checked_public(config)
    config = resolved(config, public)
    from conclave.cluster.ray_runtime import start_ray

    with waiting("starting Ray", progress):
        start_ray(ray_address, runtime_env=config.runtime_env, models=config.models)
    return train_teachers(config, progress=progress, public=public)


@dataclass
class Ensemble:
    """The started vote source (``pool``, the aggregator's: trained teachers, the actors whose
    records vote, or the owners' gateways) and the driver's public data; the private data stays with the
    actors, or behind the owners' gateways. ``local``: the gateways this run started on this machine
    for owners named by their data (None: none). A context manager: leaving it stops the actors and
    those gateways."""

    public: PublicData
    pool: TeacherPool | KnnVoteSource | ClusterVoteSource | GatewayVoteSource
    local: LocalGateways | None = None

    @property
    def splits(self) -> StudentSplits:
        return self.public.splits

    @property
    def nodes(self) -> dict[str, list[str]]:
        """Owner → where its votes are counted: the Ray node ids of its actors, or its gateway's address."""
        return self.pool.placement

    def owner_accounts(self) -> dict[str, GatewayAccount]:
        """Each owner's lifetime account as its gateway reports it now (none without owners)."""
        from conclave.cluster.gateway.client import GatewayVoteSource

        if not isinstance(self.pool, GatewayVoteSource):
            return {}
        return self.pool.accounts(self.local.budget_sources if self.local is not None else {})

    def shutdown(self) -> None:
        try:
            self.pool.shutdown()
        finally:
            if self.local is not None:
                self.local.stop()

    def __enter__(self) -> Ensemble:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def train_teachers(config: TeacherStudentConfig, progress: bool = True, public: PublicData | None = None) -> Ensemble:
    """Start the config's vote source (``config.vote_source``: train the benchmark's teachers on Ray
    actors, or start the actors whose records vote), or admit the run at the owners' gateways, started
    here first for owners named by their data (Ray must be running); ``public``: the driver's data,
    when already loaded (``checked_public``)."""
    public = public if public is not None else public_data(config)
    if not config.owners:
        return Ensemble(public, config.vote_source.start(config, public, progress))
    from conclave.cluster.gateway.local import LocalGateways
    from conclave.cluster.teaching.gateways import gateway_vote_source

    local = None
    if not config.through_gateways:  # owners named by their data: their gateways on this machine, started here
        with waiting("starting the owners' gateways on this machine", progress):
            local = LocalGateways.start(config.owners, max_epochs=config.teachers.train.epochs)
        config = local.reach(config)
    try:
        with waiting("admitting the run at the owners' gateways (each starts its own vote actors)", progress):
            return Ensemble(public, gateway_vote_source(config, public), local)
    except BaseException:
        if local is not None:
            local.stop()
        raise


def student_splits(config: TeacherStudentConfig) -> StudentSplits:
    """The public pool and the test split of the ``data`` section's benchmark, all of the data
    the driver keeps. Reading the files loads the training set too, but the private split is
    dropped here, unsharded."""
    from conclave.learning.data import make_splits

    return make_splits(config.data.name, config.data.root, public_size=config.data.public_size,
                       seed=config.seed, private_size=config.data.private_size).student_side()


def public_data(config: TeacherStudentConfig) -> PublicData:
    """The driver's data: the benchmark's public side, or the config's ``public`` and ``test``
    sources (never an owner's: those are read by the owners' actors only)."""
    if not config.owners:
        splits = student_splits(config)
        return PublicData.of(splits, tuple(str(c) for c in range(splits.test.num_classes)))
    public = PublicData.read(config.public, config.test, config.classes)
    if config.student.queries > len(public.splits.public):
        raise InvalidValue(f"student.queries ({config.student.queries}) exceeds the public pool "
                         f"({len(public.splits.public)} inputs)")
    return public


def checked_public(config: TeacherStudentConfig) -> PublicData:
    """The driver's data, loaded before Ray starts: a missing file, a bad format, a size the
    data cannot satisfy or a model that does not fit the inputs (``check_models``) is a
    one-line ``ConfigError`` now, not a traceback after start-up."""
    from conclave.cluster.config import ConfigError

    try:
        public = public_data(config)
        config = resolved(config, public)  # the models and the student fit these inputs
    except (ValueError, OSError) as err:
        where = "data" if not config.owners else "public/test"
        raise ConfigError(f"{where}: {err}") from err
    check_owner_columns(config.owners, public.reading)
    check_models(config, public)
    return public


def check_models(config: TeacherStudentConfig, public: PublicData) -> None:
    """The teachers' and the student's models against the model contract
    (``learning.models.contract``) on the inputs they learn on (``public``'s shape, or its
    ``data.features``), before Ray starts: ``ConfigError``, one line, naming the key."""
    from conclave.cluster.config import ConfigError
    from conclave.learning.data.features import features_of
    from conclave.learning.models import check_model
    from conclave.learning.models.registry import REGISTRY
    from conclave.learning.selection import POOL_ORDER

    shape = public.schema.shape
    if config.data.features:  # a fixed transform: its output shape follows from the image shape alone
        shape = features_of(np.zeros((1, *shape), dtype=np.float32), config.data.features).shape[1:]
    if config.owners and not (isinstance(config.teachers.model, str) and config.teachers.model in REGISTRY):
        raise ConfigError(f"teachers.model {config.teachers.model!r}: owners' teachers train behind their gateways, "
                          "which train a registered model (a gateway runs no code a config names)")
    checks = [("teachers.model", config.teachers.model, {})]
    if config.student.selection.strategy != POOL_ORDER:
        checks.append(("student.model", config.student.model,
                       {"features": "student.selection's strategy embeds the public pool with"}))
    elif config.student.model != config.teachers.model:
        checks.append(("student.model", config.student.model, {}))
    for key, name, parts in checks:
        try:
            check_model(name, len(public.classes), shape, parts=parts, standardiser=public.standardiser)
        except ValueError as err:
            raise ConfigError(f"{key}: {err}") from None


def resolved(config: TeacherStudentConfig, public: PublicData) -> TeacherStudentConfig:
    """``config`` with what it left to the inputs filled in: the models, and for table inputs
    a student without FixMatch (its augmentations are for images). Idempotent: each library step
    resolves the config it is given at its door, because a user may call the steps one by one."""
    from conclave.learning.models import default_model

    kind = "features" if config.data.features else public.schema.kind
    teacher_model = config.teachers.model or ("scatternet_cnn" if kind == "features"
                                              else default_model(public.schema.shape, kind))
    student_model = config.student.model or teacher_model
    student = config.student
    if kind == "table" and student.semi_supervised is not None:
        if student != DEFAULT_STUDENT:
            raise InvalidValue("student.semi_supervised (FixMatch) augments images; for table inputs "
                             "use pseudo_label_threshold or neither")
        student = DEFAULT_TABLE_STUDENT
    return dataclasses.replace(config, teachers=dataclasses.replace(config.teachers, model=teacher_model),
                               student=dataclasses.replace(student, model=student_model))


def teacher_source(config: TeacherStudentConfig) -> TeacherSource:
    """The spec of the teachers' private shards of the ``data`` section's benchmark, which only
    the teacher actors load."""
    from conclave.actors.teacher import TeacherSource

    return TeacherSource(config.data.name, config.data.root, public_size=config.data.public_size,
                         num_teachers=config.teachers.count, seed=config.seed,
                         private_size=config.data.private_size, features=config.data.features)


def teacher_pool(config: TeacherStudentConfig, public: PublicData, num_teachers: int | None = None,
                 with_records: Callable[[list[OwnerShare]], list[OwnerShare]] | None = None) -> TeacherPool:
    """Untrained teacher actors of the benchmark (``data``), packed as ``config.teachers`` says (all
    ``teachers.count``, or the first ``num_teachers`` of them: the benchmark compares a few).
    Teachers reserve half the CPUs; the student (and the aggregator in the driver) the rest.
    ``with_records``: an audit run's share, its records added to the benchmark's
    (``cluster.auditing.labels``). Owners' teachers train behind their gateways instead."""
    import ray

    from conclave.actors.placement import cpu_share
    from conclave.actors.teacher import OwnerShare, TeacherPool

    if config.owners:
        raise InvalidValue("owners' teachers train behind their gateways, not in the coordinator's cluster")
    config = resolved(config, public)
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    count = config.teachers.count if num_teachers is None else num_teachers
    per_actor = config.teachers.per_actor
    num_actors = min(math.ceil(count / per_actor) if per_actor else max(1, int(cpus)), count)
    shares = [OwnerShare(teacher_source(config), count, num_actors)]
    if with_records is not None:
        shares = with_records(shares)
    total_actors = sum(min(share.num_actors, share.num_teachers) for share in shares)
    train = dataclasses.replace(config.teachers.train, seed=config.seed)
    return TeacherPool(shares, config.teachers.model, train, seed=config.seed,
                       num_cpus_per_actor=cpu_share(cpus / 2, total_actors), standardiser=public.standardiser)
