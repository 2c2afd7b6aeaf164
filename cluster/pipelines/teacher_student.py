"""The main job: private shards → teacher actors → gRPC aggregator → student → ε report.

1. Split the data PATE's way (private train set; public pool and test from the test set),
   one disjoint shard of the private part per teacher. The driver keeps only the public
   pool and the test split; it never holds private shards.
2. Train the teachers on Ray actors (``actors.teacher.TeacherPool``), several per actor;
   each actor loads its own shards from a ``TeacherSource`` spec.
3. Serve them through the gRPC aggregator on 127.0.0.1 with a fresh bearer token; the
   configured mechanism answers and the privacy ledger is charged before each release.
4. A student actor asks for labels over gRPC, like any outside client, trains on the
   answers and is evaluated on the test split (at several query checkpoints).
5. Report privacy (``privacy.json``): the guarantee — the budget declared in advance,
   enforced by the ledger as a Rényi filter, or the worst case of the planned queries (all
   answered), whichever is smaller — and, labelled as estimates, the smooth-sensitivity
   release of the data-dependent cost when ``estimates.smooth_sensitivity`` asks for it
   (its own cost is planned and charged) and, for NZC, the paper's claimed ε≈0 beside the
   guarantee, which is unbounded. Nothing computed from the private votes or the teachers'
   training (losses, the noiseless plurality's accuracy) is written.

With ``data.features`` (e.g. scattering) the teachers and the student learn on a fixed
representation of the images, each computing it in its own process (teacher actors for their
shards and every query, the student for its answered images and test split); the student and
outside clients still send images, so the gRPC API and its shape checks are unchanged.

``Config()`` is the demo (``conclave demo``): digits, 50 teachers, Confident-GNMax under a
budget of ε = 4, a FixMatch student (about a minute on 2 CPUs).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from conclave.cluster.owners import DataOwner, PublicData, check_owner_columns, check_owners, owner_data
from conclave.cluster.pipelines import SECURE_VOTES, TRUSTED_AGGREGATOR, PrivacyConfig, RunOutcome
from conclave.learning.data.dataset import SHARD_LEMMA, StudentSplits
from conclave.learning.data.features import check_features
from conclave.learning.data.sources import DataSource
from conclave.learning.selection import QuerySelection
from conclave.learning.semi_supervised import FixMatchConfig
from conclave.privacy.accounting.charge import ADD_REMOVE, PrivacyCharge
from conclave.privacy.accounting.report import planned_charge
from conclave.privacy.accounting.smooth_sensitivity import SmoothSensitivityParameters
from conclave.privacy.mechanisms import SecureVoteMechanism, VoteMechanism, build_mechanism, secure_mechanism

if TYPE_CHECKING:  # imported where used: loading a config needs neither torch nor Ray
    from conclave.actors.teacher import OwnerShare, TeacherPool, TeacherSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataConfig:
    name: str = "digits"  # digits | mnist | cifar10 | cifar100 | svhn
    root: str | None = None  # directory of the files (not needed for digits)
    public_size: int = 300  # the student's pool: the first public_size of the shuffled test set
    private_size: int | None = None  # subsample the teachers' data (None: the whole train set)
    # A fixed representation the teachers and the student learn on, e.g. scattering
    # (learning.data.features); queries stay images, so the gRPC API does not change.
    features: str | None = None

    def __post_init__(self) -> None:
        check_features(self.features, "data.features")
        if self.public_size < 1:
            raise ValueError(f"data.public_size must be >= 1, got {self.public_size}")
        if self.private_size is not None and self.private_size < 1:
            raise ValueError(f"data.private_size must be >= 1 or null, got {self.private_size}")


@dataclass(frozen=True)
class TrainingConfig:
    """How one model is trained; the seed comes from the run's ``seed``."""

    epochs: int = 5
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"epochs and batch_size must be >= 1, got {self.epochs}, {self.batch_size}")
        if not self.lr > 0 or self.weight_decay < 0:
            raise ValueError(f"lr must be > 0 and weight_decay >= 0, got {self.lr}, {self.weight_decay}")

    def with_seed(self, seed: int):
        from conclave.learning.training import TrainConfig

        return TrainConfig(epochs=self.epochs, batch_size=self.batch_size, lr=self.lr,
                           weight_decay=self.weight_decay, seed=seed)


@dataclass(frozen=True)
class OwnerConfig(DataOwner):
    """A data owner (``cluster.owners.DataOwner``) and its ``teachers``, packed into its
    ``actors``. ``records``, if declared, is a public upper bound: each teacher keeps at most its
    share of it (``actors.owners.OwnerSource``); fewer records held is no error."""

    teachers: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.teachers < 1:
            raise ValueError(f"owner {self.name}: teachers must be >= 1")
        if self.records is not None and self.records < self.teachers:
            raise ValueError(f"owner {self.name}: {self.teachers} teachers need at least as many records "
                             f"(it declares {self.records})")


@dataclass(frozen=True)
class TeachersConfig:
    count: int | None = None  # Config fills it in: the owners' teachers summed, else DEFAULT_TEACHERS
    per_actor: int | None = None  # teachers packed per Ray actor (None: one actor per CPU)
    model: str | None = None  # None: by the inputs (learning.models.default_model)
    train: TrainingConfig = field(default_factory=lambda: TrainingConfig(epochs=60, batch_size=32, lr=3e-3))

    def __post_init__(self) -> None:
        if self.count is not None and self.count < 1:
            raise ValueError(f"teachers.count must be >= 1, got {self.count}")
        if self.per_actor is not None and self.per_actor < 1:
            raise ValueError(f"teachers.per_actor must be >= 1 or null, got {self.per_actor}")


DEFAULT_TEACHERS = 50  # without owners and without teachers.count
# Confident-GNMax's threshold T when a config leaves it out, as a share of the teachers n. The
# test passes when the top count plus N(0, σ1²) reaches T: at 0.6 n a unanimous vote passes
# with probability Φ(0.4 n/σ1), a 60% plurality half the time. The demo's T = 30 of 50 (σ1 =
# 20 = 0.4 n: 84% for a unanimous vote); Papernot et al. 2018 used 200 of 250 on MNIST (0.8,
# σ1 = 150) and 300 of 250 on SVHN, where many queries abstain by design.
THRESHOLD_SHARE = 0.6


@dataclass(frozen=True)
class MechanismConfig:
    """A ``privacy.mechanisms.build_mechanism`` name and its parameters. Confident-GNMax's
    ``threshold``, left out, is ``THRESHOLD_SHARE`` of the teachers (``Config`` fills it in)."""

    name: str = "confident-gnmax"
    params: dict = field(default_factory=lambda: {"sigma1": 20.0, "sigma2": 12.0})

    def __post_init__(self) -> None:
        self.for_teachers(1).build()  # an unknown name or a bad parameter is a config error now, not mid-run

    def for_teachers(self, teachers: int) -> MechanismConfig:
        """This mechanism with what it left to the ensemble's size filled in."""
        if self.name != "confident-gnmax" or self.params.get("threshold") is not None:
            return self
        return dataclasses.replace(self, params={**self.params, "threshold": THRESHOLD_SHARE * teachers})

    def build(self):
        try:
            return build_mechanism(self.name, **self.params)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"mechanism {self.name!r} with params {self.params}: {err}") from err


@dataclass(frozen=True)
class EstimatesConfig:
    """Data-dependent estimates published beside the guarantee (never as it).

    ``smooth_sensitivity``: release the PATE 2018 data-dependent cost by smooth sensitivity
    (GNMax family). Its parameters are fixed before any vote is seen — given here, or derived
    from the planned worst case — and its own cost is part of the planned work the budget
    and the guarantee cover.
    """

    smooth_sensitivity: bool = False
    order: float | None = None
    beta: float | None = None
    sigma_ss: float | None = None

    def __post_init__(self) -> None:
        fixed = (self.order, self.beta, self.sigma_ss)
        if any(v is not None for v in fixed) and any(v is None for v in fixed):
            raise ValueError("estimates: order, beta and sigma_ss go together (or none, for the defaults)")
        if all(v is not None for v in fixed):
            SmoothSensitivityParameters(*fixed)  # a bad value is a config error now

    def parameters(self, mechanism, queries: int, delta: float) -> SmoothSensitivityParameters | None:
        """The release's parameters, from public settings only (None when off or not applicable)."""
        if not self.smooth_sensitivity or not hasattr(mechanism, "smooth_sensitivity_terms"):
            return None
        if self.order is not None:
            return SmoothSensitivityParameters(self.order, self.beta, self.sigma_ss)
        return SmoothSensitivityParameters.for_workload(mechanism.run_charge(queries, queries), delta)


@dataclass(frozen=True)
class StudentConfig:
    queries: int = 300  # inputs of the public pool asked, in pool order
    batch_size: int = 50  # inputs per gRPC call
    checkpoints: tuple[int, ...] = (50, 100, 200)  # also train+evaluate after this many asked
    model: str | None = None  # None: by the inputs (learning.models.default_model)
    train: TrainingConfig = field(default_factory=lambda: TrainingConfig(epochs=40, batch_size=32, lr=3e-3))
    # Self-training on the rest of the public pool (free post-processing; actors/student.py):
    # the student's own predictions at least this confident become extra labels. null: off.
    pseudo_label_threshold: float | None = None
    # FixMatch on the whole pool (learning.semi_supervised; free post-processing). null: off.
    semi_supervised: FixMatchConfig | None = None
    # Which pool inputs to ask about: the pool in order, or rounds of an active-learning strategy.
    selection: QuerySelection = field(default_factory=QuerySelection)

    def __post_init__(self) -> None:
        if self.pseudo_label_threshold is not None and self.semi_supervised is not None:
            raise ValueError("student: choose pseudo_label_threshold (self-training) or semi_supervised (FixMatch)")
        if self.pseudo_label_threshold is not None and not 0 < self.pseudo_label_threshold <= 1:
            raise ValueError(f"student.pseudo_label_threshold must be in (0, 1] or null, "
                             f"got {self.pseudo_label_threshold}")
        if self.queries < 1 or self.batch_size < 1:
            raise ValueError(f"student.queries and student.batch_size must be >= 1, got "
                             f"{self.queries}, {self.batch_size}")
        if any(c < 1 for c in self.checkpoints):
            raise ValueError(f"student.checkpoints must be positive, got {list(self.checkpoints)}")


@dataclass(frozen=True)
class ServerConfig:
    """How ``conclave serve`` listens (``actors.aggregator.ServerSettings`` says what each means)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port
    max_batch: int = 1024
    tls_cert: str | None = None  # PEM: serve TLS (with tls_key)
    tls_key: str | None = None
    tls_client_ca: str | None = None  # PEM: also require client certificates it signed (mutual TLS)
    allow_plaintext: bool = False  # a non-loopback host without TLS is refused unless this is set

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"server.port must be in [0, 65535], got {self.port}")
        if self.max_batch < 1:
            raise ValueError(f"server.max_batch must be >= 1, got {self.max_batch}")


DEFAULT_STUDENT = StudentConfig(batch_size=20, semi_supervised=FixMatchConfig(epochs=60, batch_size=32, threshold=0.9))
# For table inputs FixMatch (image augmentations) does not apply: self-training instead.
DEFAULT_TABLE_STUDENT = dataclasses.replace(DEFAULT_STUDENT, semi_supervised=None, pseudo_label_threshold=0.9)


AGGREGATIONS = (TRUSTED_AGGREGATOR.aggregation, SECURE_VOTES.aggregation)
SECURE_NO_ESTIMATES = ("no data-dependent estimate: they are computed from the clean votes, which aggregation: secure "
                       "never shows anyone; the guarantee is the data-independent one")


@dataclass(frozen=True)
class Config:
    name: str = "demo"
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    teachers: TeachersConfig = field(default_factory=TeachersConfig)
    mechanism: MechanismConfig = field(default_factory=MechanismConfig)
    privacy: PrivacyConfig = field(default_factory=lambda: PrivacyConfig(budget=4.0))
    estimates: EstimatesConfig = field(default_factory=EstimatesConfig)
    student: StudentConfig = field(default_factory=lambda: DEFAULT_STUDENT)
    server: ServerConfig = field(default_factory=ServerConfig)
    # Owners' own data (instead of ``data``): each owner's source is read only by its actors.
    owners: tuple[OwnerConfig, ...] = ()
    public: DataSource | None = None  # the student's pool (labels optional), read by the driver
    test: DataSource | None = None  # labelled public test data, read by the driver
    classes: tuple[str, ...] | None = None  # the label names, in class order (None: the test data's)
    # Ray's runtime_env for the run's workers, e.g. {py_modules: [./mypkg]} for a model of your own.
    runtime_env: dict = field(default_factory=dict)
    # Who sees the votes: "trusted-aggregator" (PATE's classic trust: the aggregator adds clean
    # histograms) or "secure" (they meet only in the secure sum with distributed Skellam noise:
    # privacy/secure_votes.py, docs/privacy.md "Who sees what"; gnmax and confident-gnmax).
    aggregation: str = TRUSTED_AGGREGATOR.aggregation

    def __post_init__(self) -> None:
        if self.owners:
            self._check_owners()
        elif self.public is not None or self.test is not None or self.classes is not None:
            raise ValueError("public, test and classes go with owners (or use the data section alone)")
        # What the config left to the declared counts, filled in once (so config.json says it).
        count = self.num_teachers if self.owners else (self.teachers.count or DEFAULT_TEACHERS)
        object.__setattr__(self, "teachers", dataclasses.replace(self.teachers, count=count))
        object.__setattr__(self, "mechanism", self.mechanism.for_teachers(count))
        if not self.owners and self.student.queries > self.data.public_size:
            raise ValueError(f"student.queries ({self.student.queries}) exceeds the public pool "
                             f"(data.public_size = {self.data.public_size})")
        if self.student.batch_size > self.server.max_batch:
            raise ValueError(f"student.batch_size ({self.student.batch_size}) exceeds "
                             f"server.max_batch ({self.server.max_batch})")
        if self.mechanism.name == "nzc" and self.privacy.budget is not None:
            raise ValueError("mechanism nzc has no finite DP guarantee, so no budget can gate it: "
                             "set privacy.budget to null (the run records its spend and reports it unbounded)")
        self._check_aggregation()
        self.privacy.budget_filter(self.planned())  # a budget too small for any order is a config error now

    def _check_aggregation(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        if self.secure:
            self.vote_mechanism()  # a mechanism without a secure variant is refused now, in one line
            if self.estimates.smooth_sensitivity:
                raise ValueError("estimates.smooth_sensitivity analyses the clean votes, which aggregation: secure "
                                 "never shows the aggregator: turn it off")

    def _check_owners(self) -> None:
        check_owners(self.owners, self.test, self.classes, self.public)
        if dataclasses.replace(self.data, features=None) != DataConfig():
            raise ValueError("with owners, the data section may only set features (the sources say the rest)")
        if self.teachers.count not in (None, self.num_teachers):
            # Replaced, not refused: a config rebuilt with other owners (dataclasses.replace) still
            # carries the count derived from the old ones.
            log.warning("teachers.count %d is replaced by the owners' %d teachers (with owners it is their sum: "
                        "leave it out)", self.teachers.count, self.num_teachers)

    @property
    def models(self) -> tuple[str | None, ...]:
        """The models this run builds (None: chosen by the inputs, a built-in one)."""
        return self.teachers.model, self.student.model

    @property
    def num_teachers(self) -> int:
        return sum(owner.teachers for owner in self.owners) if self.owners else self.teachers.count

    @property
    def secure(self) -> bool:
        return self.aggregation == SECURE_VOTES.aggregation

    def vote_mechanism(self) -> VoteMechanism | SecureVoteMechanism:
        """What the aggregator runs: the configured mechanism, or with ``aggregation: secure`` its
        variant over secure-sum vote totals (ValueError naming the mechanisms that have one)."""
        mechanism = self.mechanism.build()
        return secure_mechanism(mechanism) if self.secure else mechanism

    def smooth_sensitivity(self) -> SmoothSensitivityParameters | None:
        return self.estimates.parameters(self.mechanism.build(), self.student.queries, self.privacy.delta)

    def planned(self, answers: int | None = None) -> PrivacyCharge:
        """The worst case of the planned work, on add/remove neighbours of the owners' records:
        ``answers`` queries answered (default: every one of ``student.queries``), plus the
        smooth-sensitivity release if asked (fixed by ``student.queries``)."""
        answered = self.student.queries if answers is None else answers
        planned = planned_charge(self.vote_mechanism(), answered, self.smooth_sensitivity())
        return planned.for_records(ADD_REMOVE, SHARD_LEMMA)


# --- phases -----------------------------------------------------------------------------


@dataclass
class Ensemble:
    """Trained teachers (``pool``, the aggregator's vote source) and the driver's public data;
    the private data stays with the teacher actors, on their owners' nodes. A context manager:
    leaving it stops the actors."""

    public: PublicData
    pool: TeacherPool
    seconds: float  # training time: for benchmarks only, never published from a run (it grows with the records)

    @property
    def splits(self) -> StudentSplits:
        return self.public.splits

    @property
    def nodes(self) -> dict[str, list[str]]:
        """Owner → the Ray node ids its teachers run on."""
        return self.pool.placement

    def shutdown(self) -> None:
        self.pool.shutdown()

    def __enter__(self) -> Ensemble:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def train_teachers(config: Config, progress: bool = True, public: PublicData | None = None,
                   embedded: bool = True) -> Ensemble:
    """Train the teachers on Ray actors, which read their own data (Ray must be running);
    ``public``: the driver's data, when already loaded (``checked_public``); ``embedded``:
    whether this is the embedded one-node Ray (owners' node labels are then not used)."""
    public = public if public is not None else public_data(config)
    started = time.perf_counter()
    pool = teacher_pool(config, public, embedded=embedded)
    try:
        pool.train(progress=progress)
    except BaseException:
        pool.shutdown()
        raise
    # The time goes to the caller (a benchmark's own measurement), never to a log or a run's
    # results: it grows with the private records each teacher holds.
    log.info("teachers: %d trained on %d actors", pool.num_teachers, pool.num_actors)
    return Ensemble(public, pool, time.perf_counter() - started)


def student_splits(config: Config) -> StudentSplits:
    """The public pool and the test split of the ``data`` section's benchmark, all of the data
    the driver keeps. Reading the files loads the training set too, but the private split is
    dropped here, unsharded."""
    from conclave.learning.data import make_splits

    return make_splits(config.data.name, config.data.root, public_size=config.data.public_size,
                       seed=config.seed, private_size=config.data.private_size).student_side()


def public_data(config: Config) -> PublicData:
    """The driver's data: the benchmark's public side, or the config's ``public`` and ``test``
    sources (never an owner's: those are read by the owners' actors only)."""
    if not config.owners:
        splits = student_splits(config)
        return PublicData.of(splits, tuple(str(c) for c in range(splits.test.num_classes)))
    public = PublicData.read(config.public, config.test, config.classes)
    if config.student.queries > len(public.splits.public):
        raise ValueError(f"student.queries ({config.student.queries}) exceeds the public pool "
                         f"({len(public.splits.public)} inputs)")
    return public


def checked_public(config: Config) -> PublicData:
    """The driver's data, loaded before Ray starts: a missing file, a bad format, a size the
    data cannot satisfy or a model that does not fit the inputs (``check_models``) is a
    one-line ``ConfigError`` now, not a traceback after start-up."""
    from conclave.cluster.config import ConfigError

    try:
        public = public_data(config)
        resolved(config, public)  # the models and the student fit these inputs
    except (ValueError, OSError) as err:
        where = "data" if not config.owners else "public/test"
        raise ConfigError(f"{where}: {err}") from err
    check_owner_columns(config.owners, public.schema.columns)
    check_models(resolved(config, public), public)
    return public


def check_models(config: Config, public: PublicData) -> None:
    """The teachers' and the student's models against the model contract
    (``learning.models.contract``) on the inputs they learn on (``public``'s shape, or its
    ``data.features``), before Ray starts: ``ConfigError``, one line, naming the key."""
    from conclave.cluster.config import ConfigError
    from conclave.learning.data.features import features_of
    from conclave.learning.models import check_model
    from conclave.learning.selection import POOL_ORDER

    shape = public.schema.shape
    if config.data.features:  # a fixed transform: its output shape follows from the image shape alone
        shape = features_of(np.zeros((1, *shape), dtype=np.float32), config.data.features).shape[1:]
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


def resolved(config: Config, public: PublicData) -> Config:
    """``config`` with what it left to the inputs filled in: the models, and for table inputs
    a student without FixMatch (its augmentations are for images)."""
    from conclave.learning.models import default_model

    kind = "features" if config.data.features else public.schema.kind
    teacher_model = config.teachers.model or ("scatternet_cnn" if kind == "features"
                                              else default_model(public.schema.shape, kind))
    student_model = config.student.model or teacher_model
    student = config.student
    if kind == "table" and student.semi_supervised is not None:
        if student != DEFAULT_STUDENT:
            raise ValueError("student.semi_supervised (FixMatch) augments images; for table inputs "
                             "use pseudo_label_threshold or neither")
        student = DEFAULT_TABLE_STUDENT
    return dataclasses.replace(config, teachers=dataclasses.replace(config.teachers, model=teacher_model),
                               student=dataclasses.replace(student, model=student_model))


def teacher_source(config: Config) -> TeacherSource:
    """The spec of the teachers' private shards of the ``data`` section's benchmark, which only
    the teacher actors load."""
    from conclave.actors.teacher import TeacherSource

    return TeacherSource(config.data.name, config.data.root, public_size=config.data.public_size,
                         num_teachers=config.teachers.count, seed=config.seed,
                         private_size=config.data.private_size, features=config.data.features)


def owner_shares(config: Config, public: PublicData, embedded: bool, num_actors: int,
                 count: int) -> list[OwnerShare]:
    """Each owner's source (a table read by the public schema's column names), teachers, actors
    and placement (the benchmark: one share of its first ``count`` teachers on ``num_actors``
    actors, anywhere)."""
    from conclave.actors.owners import OwnerSource
    from conclave.actors.teacher import OwnerShare

    if not config.owners:
        return [OwnerShare(teacher_source(config), count, num_actors)]
    # A relative path is the launching directory's (on a cluster, give owners absolute paths).
    here = os.getcwd()
    return [OwnerShare(OwnerSource(owner.name, owner_data(owner, public.schema.columns, here), owner.teachers,
                                   public.classes, config.seed, config.data.features, owner.records),
                       owner.teachers, owner.actors, owner.placement(embedded))
            for owner in config.owners]


def teacher_pool(config: Config, public: PublicData, num_teachers: int | None = None,
                 embedded: bool = True) -> TeacherPool:
    """Untrained teacher actors: the owners' on their nodes, or the benchmark's packed as
    ``config.teachers`` says (all ``teachers.count``, or the first ``num_teachers`` of them:
    the benchmark compares a few). Teachers reserve half the CPUs; the student (and the
    aggregator in the driver) the rest."""
    import ray

    from conclave.actors.teacher import TeacherPool

    config = resolved(config, public)
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    count = config.teachers.count if num_teachers is None else num_teachers
    per_actor = config.teachers.per_actor
    num_actors = min(math.ceil(count / per_actor) if per_actor else max(1, int(cpus)), count)
    shares = owner_shares(config, public, embedded, num_actors, count)
    total_actors = sum(min(share.num_actors, share.num_teachers) for share in shares)
    return TeacherPool(shares, config.teachers.model, config.teachers.train.with_seed(config.seed),
                       seed=config.seed, num_cpus_per_actor=max(cpus / 2, 0.01) / total_actors,
                       standardiser=public.standardiser)


def server_settings(config: Config, token: str, **overrides: Any):
    """The aggregator's ``ServerSettings`` from ``config.server`` (``overrides`` that are not
    None replace its fields; ``ValueError`` names a bad one, e.g. plaintext on a public host)."""
    from conclave.actors.aggregator import ServerSettings

    fields = {**dataclasses.asdict(config.server), **{k: v for k, v in overrides.items() if v is not None}}
    return ServerSettings(token=token, **fields)


def start_aggregator(config: Config, pool, ledger, settings):
    """The gRPC aggregator over ``pool`` in this process; returns (server, "host:port")."""
    from conclave.actors.aggregator import AggregatorServer

    server = AggregatorServer(pool, config.vote_mechanism(), ledger, pool.input_shape, settings,
                              noise=config.privacy.noise)
    return server, server.start()


def privacy_section(config: Config, ledger, votes: np.ndarray | None, answered: np.ndarray | None) -> dict[str, Any]:
    """What a run may publish about its privacy (``privacy.json``).

    The guarantee and what was spent (``PrivacyConfig.report``), the mechanism, and the
    report of the votes it answered: only its public view, i.e. the estimates that are not
    computed from the private votes without a mechanism — the smooth-sensitivity release
    (whose cost ``reserve_estimates`` charged before the first query) or NZC's claim. With
    ``aggregation: secure`` there are no votes (None): nobody saw them, so no estimate exists.
    """
    from conclave.privacy.accounting.report import vote_report

    planned = config.planned()
    section: dict[str, Any] = {**config.privacy.report(planned, ledger,
                                                       SECURE_VOTES if config.secure else TRUSTED_AGGREGATOR),
                               "mechanism": config.vote_mechanism().describe().as_dict(),
                               "delta": config.privacy.delta, "estimates": []}
    if config.secure:
        section["estimates_note"] = SECURE_NO_ESTIMATES
    elif len(votes):
        report = vote_report(config.mechanism.build(), votes, answered, config.privacy.delta,
                             config.privacy.guarantee(planned), smooth=config.smooth_sensitivity(),
                             noise=config.privacy.noise.source("smooth-sensitivity")).public()
        section.update(estimates=report["estimates"], queries=report["queries"], answered=report["answered"])
    return section


def reserve_estimates(config: Config, ledger) -> None:
    """Charge the smooth-sensitivity release before the first query: its cost is fixed by
    public parameters, and paying first keeps a student that spends the budget from leaving
    no room for it."""
    smooth = config.smooth_sensitivity()
    if smooth is not None:
        ledger.charge(smooth.charge(ledger.orders).for_records(ADD_REMOVE, SHARD_LEMMA))


def planned_work(config: Config) -> PrivacyCharge:
    return config.planned()


def validate(config: Config) -> Config:
    """Everything the driver can check before Ray starts (``ConfigError``, one line): its
    public data, the models for those inputs. Returns the config with its defaults resolved."""
    return resolved(config, checked_public(config))


def run(config: Config, context) -> RunOutcome:
    from conclave.cluster import api

    with api.train_ensemble(config, context.ray_address) as ensemble:
        return teach_student(config, ensemble, context.results)


def teach_student(config: Config, teachers: Ensemble, results) -> RunOutcome:
    """Serve ``teachers`` over gRPC, let a student actor learn from them, write the results.

    Separate from ``run`` so one set of trained teachers can serve several mechanisms
    (the benchmark does this for the three 250-teacher MNIST configs).
    """
    from conclave.cluster import api

    config = resolved(config, teachers.public)
    phases: dict[str, float] = {}  # no teacher training time: it grows with the private records
    with api.serve(config, teachers, results.path / "ledger.sqlite") as aggregator:
        student = api.train_student(config, teachers, aggregator)
        aggregator.stop()
        started = time.perf_counter()
        privacy = aggregator.privacy_report()
        phases.update(query=student.query_seconds, train_student=student.train_seconds,
                      privacy_analysis=time.perf_counter() - started)
    metrics = {
        "student_accuracy": student.accuracy,
        "label_accuracy": student.label_accuracy,  # released labels against the pool's truth (None: no labels)
        "queries_asked": student.asked,
        "queries_answered": student.answered,
        "budget_exhausted": student.budget_exhausted,
        "labels_per_second": student.labels_per_second,
        "teachers": {"count": teachers.pool.num_teachers, "actors": teachers.pool.num_actors,
                     "model": config.teachers.model,
                     "nodes": teachers.nodes},  # owner → Ray node ids its teachers ran on
        "curve": student.curve,
        "seconds": phases,
    }
    results.write_json("metrics", metrics)
    results.write_json("privacy", privacy)
    _plots(results, student.curve)
    summary = {
        "student_accuracy": round(student.accuracy, 4),
        "label_accuracy": None if student.label_accuracy is None else round(student.label_accuracy, 4),
        "queries_asked": student.asked,
        "queries_answered": student.answered,
        "epsilon": _epsilon_line(config, privacy),
    }
    return RunOutcome(summary, metrics, privacy)


def _epsilon_line(config: Config, privacy: dict[str, Any]) -> str:
    guarantee = privacy["guarantee"]
    epsilon = guarantee["epsilon"]
    line = (f"guarantee ε = {epsilon:.3g} at δ = {guarantee['delta']:g} ({guarantee['basis']})"
            if epsilon != float("inf") else "guarantee ε = inf: no finite guarantee")
    if guarantee["unsound_reasons"]:
        line += "; NOT SOUND: " + "; ".join(guarantee["unsound_reasons"])
    for estimate in privacy.get("estimates", []):
        if estimate["epsilon"] is not None:
            line += f"; {estimate['name']} estimate ε = {estimate['epsilon']:.3g} (not a DP guarantee)"
    return line


def _plots(results, curve: list[dict[str, Any]]) -> None:
    answered = [p["answered"] for p in curve]
    results.plot("student_accuracy", answered, {"student": [p["accuracy"] for p in curve]},
                 xlabel="answered queries", ylabel="student test accuracy")
    epsilons = [float(p["budget"].get("epsilon_spent", math.nan)) for p in curve]
    if all(math.isfinite(e) for e in epsilons):
        results.plot("epsilon_spent", answered, {"realised spend (the guarantee is the budget)": epsilons},
                     xlabel="answered queries", ylabel="ε spent (ledger)")

