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
import functools
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from cluster.pipelines import PrivacyConfig
from learning.data.dataset import SHARD_LEMMA
from learning.data.features import check_features
from learning.selection import QuerySelection
from learning.semi_supervised import FixMatchConfig
from privacy.accounting.charge import ADD_REMOVE, PrivacyCharge
from privacy.accounting.report import planned_charge
from privacy.accounting.smooth_sensitivity import SmoothSensitivityParameters
from privacy.mechanisms import build_mechanism

if TYPE_CHECKING:  # imported where used: loading a config needs neither torch nor Ray
    from actors.teacher import TeacherPool, TeacherSource
    from learning.data import StudentSplits

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
        from learning.training import TrainConfig

        return TrainConfig(epochs=self.epochs, batch_size=self.batch_size, lr=self.lr,
                           weight_decay=self.weight_decay, seed=seed)


@dataclass(frozen=True)
class TeachersConfig:
    count: int = 50
    per_actor: int | None = None  # teachers packed per Ray actor (None: one actor per CPU)
    model: str = "digits_cnn"
    train: TrainingConfig = field(default_factory=lambda: TrainingConfig(epochs=60, batch_size=32, lr=3e-3))

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"teachers.count must be >= 1, got {self.count}")
        if self.per_actor is not None and self.per_actor < 1:
            raise ValueError(f"teachers.per_actor must be >= 1 or null, got {self.per_actor}")


@dataclass(frozen=True)
class MechanismConfig:
    """A ``privacy.mechanisms.build_mechanism`` name and its parameters."""

    name: str = "confident-gnmax"
    params: dict = field(default_factory=lambda: {"threshold": 30.0, "sigma1": 20.0, "sigma2": 12.0})

    def __post_init__(self) -> None:
        self.build()  # an unknown name or a bad parameter is a config error now, not mid-run

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
    model: str = "digits_cnn"
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


@dataclass(frozen=True)
class Config:
    name: str = "demo"
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    teachers: TeachersConfig = field(default_factory=TeachersConfig)
    mechanism: MechanismConfig = field(default_factory=MechanismConfig)
    privacy: PrivacyConfig = field(default_factory=lambda: PrivacyConfig(budget=4.0))
    estimates: EstimatesConfig = field(default_factory=EstimatesConfig)
    student: StudentConfig = field(default_factory=lambda: StudentConfig(
        batch_size=20, semi_supervised=FixMatchConfig(epochs=60, batch_size=32, threshold=0.9)))
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        if self.student.queries > self.data.public_size:
            raise ValueError(f"student.queries ({self.student.queries}) exceeds the public pool "
                             f"(data.public_size = {self.data.public_size})")
        if self.student.batch_size > self.server.max_batch:
            raise ValueError(f"student.batch_size ({self.student.batch_size}) exceeds "
                             f"server.max_batch ({self.server.max_batch})")
        if self.mechanism.name == "nzc" and self.privacy.budget is not None:
            raise ValueError("mechanism nzc has no finite DP guarantee, so no budget can gate it: "
                             "set privacy.budget to null (the run records its spend and reports it unbounded)")
        self.privacy.budget_filter(self.planned())  # a budget too small for any order is a config error now

    def smooth_sensitivity(self) -> SmoothSensitivityParameters | None:
        return self.estimates.parameters(self.mechanism.build(), self.student.queries, self.privacy.delta)

    def planned(self) -> PrivacyCharge:
        """The worst case of the planned work, on add/remove neighbours of the owners' records:
        every one of ``student.queries`` answered, plus the smooth-sensitivity release if asked."""
        planned = planned_charge(self.mechanism.build(), self.student.queries, self.smooth_sensitivity())
        return planned.for_records(ADD_REMOVE, SHARD_LEMMA)


# --- phases -----------------------------------------------------------------------------


@dataclass
class Teachers:
    """Trained teachers and the student's splits of the same data (the private split stays
    with the teacher actors)."""

    splits: StudentSplits
    pool: Any
    seconds: float


def train_teachers(config: Config, progress: bool = True, splits: StudentSplits | None = None) -> Teachers:
    """Train the teachers on Ray actors, which read their own shards (Ray must be running);
    ``splits``: the driver's public and test data, when already loaded (``checked_splits``)."""
    splits = splits if splits is not None else student_splits(config)
    started = time.perf_counter()
    pool = teacher_pool(config)
    pool.train(progress=progress)
    seconds = time.perf_counter() - started
    log.info("teachers: %d trained on %d actors in %.1f s", pool.num_teachers, pool.num_actors, seconds)
    return Teachers(splits, pool, seconds)


def student_splits(config: Config) -> StudentSplits:
    """The public pool and the test split, all of the data the driver keeps. Reading the
    files loads the training set too, but the private split is dropped here, unsharded."""
    from learning.data import make_splits

    return make_splits(config.data.name, config.data.root, public_size=config.data.public_size,
                       seed=config.seed, private_size=config.data.private_size).student_side()


def checked_splits(config: Config) -> StudentSplits:
    """The driver's data, loaded before Ray starts: a missing file, a bad format or a size the
    dataset cannot satisfy is a one-line ``ConfigError`` now, not a traceback after start-up."""
    from cluster.config import ConfigError

    try:
        return student_splits(config)
    except (ValueError, OSError) as err:
        raise ConfigError(f"data: {err}") from err


def teacher_source(config: Config) -> TeacherSource:
    """The spec of the teachers' private shards, which only the teacher actors load."""
    from actors.teacher import TeacherSource

    return TeacherSource(config.data.name, config.data.root, public_size=config.data.public_size,
                         num_teachers=config.teachers.count, seed=config.seed,
                         private_size=config.data.private_size, features=config.data.features)


def teacher_pool(config: Config, num_teachers: int | None = None) -> TeacherPool:
    """Untrained teacher actors, packed as ``config.teachers`` says: all ``teachers.count``
    teachers, or the first ``num_teachers`` of them (the benchmark compares a few)."""
    import ray

    from actors.teacher import TeacherPool

    count = config.teachers.count if num_teachers is None else num_teachers
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    per_actor = config.teachers.per_actor
    num_actors = math.ceil(count / per_actor) if per_actor else max(1, int(cpus))
    num_actors = min(num_actors, count)
    # Teachers reserve half the CPUs; the student (and the aggregator in the driver) the rest.
    return TeacherPool(teacher_source(config), count, config.teachers.model,
                       config.teachers.train.with_seed(config.seed), num_actors=num_actors, seed=config.seed,
                       num_cpus_per_actor=max(cpus / 2, 0.01) / num_actors)


def server_settings(config: Config, token: str, **overrides: Any):
    """The aggregator's ``ServerSettings`` from ``config.server`` (``overrides`` that are not
    None replace its fields; ``ValueError`` names a bad one, e.g. plaintext on a public host)."""
    from actors.aggregator import ServerSettings

    fields = {**dataclasses.asdict(config.server), **{k: v for k, v in overrides.items() if v is not None}}
    return ServerSettings(token=token, **fields)


def start_aggregator(config: Config, pool, ledger, settings):
    """The gRPC aggregator over ``pool`` in this process; returns (server, "host:port")."""
    from actors.aggregator import AggregatorServer

    server = AggregatorServer(pool, config.mechanism.build(), ledger, pool.input_shape, settings,
                              noise=config.privacy.noise)
    return server, server.start()


def privacy_section(config: Config, ledger, votes: np.ndarray, answered: np.ndarray) -> dict[str, Any]:
    """What a run may publish about its privacy (``privacy.json``).

    The guarantee and what was spent (``PrivacyConfig.report``), the mechanism, and the
    report of the votes it answered: only its public view, i.e. the estimates that are not
    computed from the private votes without a mechanism — the smooth-sensitivity release
    (whose cost ``reserve_estimates`` charged before the first query) or NZC's claim.
    """
    from privacy.accounting.report import vote_report

    planned = config.planned()
    section: dict[str, Any] = {**config.privacy.report(planned, ledger),
                               "mechanism": config.mechanism.build().describe().as_dict(),
                               "delta": config.privacy.delta, "estimates": []}
    if len(votes):
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


def run(config: Config, context) -> dict[str, Any]:
    from cluster.ray_runtime import start_ray

    splits = checked_splits(config)
    start_ray(context.ray_address)
    teachers = train_teachers(config, splits=splits)
    try:
        return teach_student(config, teachers, context.results)
    finally:
        teachers.pool.shutdown()


def teach_student(config: Config, teachers: Teachers, results) -> dict[str, Any]:
    """Serve ``teachers`` over gRPC, let a student actor learn from them, write the results.

    Separate from ``run`` so one set of trained teachers can serve several mechanisms
    (the benchmark does this for the three 250-teacher MNIST configs).
    """
    import ray

    from actors.student import StudentActor
    from cluster.client import AggregatorClient

    phases: dict[str, float] = {"train_teachers": teachers.seconds}
    ledger_path = results.path / "ledger.sqlite"
    for stale in ledger_path.parent.glob(ledger_path.name + "*"):
        stale.unlink()  # a run accounts for its own releases; serving keeps its ledger instead
    ledger = config.privacy.open_ledger(ledger_path, config.planned())
    reserve_estimates(config, ledger)
    token = secrets.token_urlsafe(24)
    server, address = start_aggregator(config, teachers.pool, ledger, server_settings(config, token))
    log.info("aggregator serving on %s", address)
    try:
        cpus = float(ray.cluster_resources().get("CPU", 1.0))
        student_cpus = min(1.0, cpus / 2)
        student = StudentActor.options(num_cpus=student_cpus).remote(
            teachers.splits.public, teachers.splits.test, config.student.model,
            config.student.train.with_seed(config.seed),
            # A teacher actor restarting makes the aggregator UNAVAILABLE for seconds: wait, nothing was charged.
            functools.partial(AggregatorClient, address, token, retry_unavailable=300.0),
            num_threads=max(1, int(student_cpus)), features=config.data.features,
            pseudo_label_threshold=config.student.pseudo_label_threshold,
            semi_supervised=config.student.semi_supervised, selection=config.student.selection,
        )
        queried = _query_with_progress(student, config.student)
        phases["query"] = queried["query_seconds"]
        started = time.perf_counter()
        curve = ray.get(student.learning_curve.remote())
        phases["train_student"] = time.perf_counter() - started
        votes, answered = server.answered_votes()
        ray.kill(student)  # frees its CPU now, not whenever the handle is collected
    finally:
        server.stop()

    teacher_summary = {"count": teachers.pool.num_teachers, "actors": teachers.pool.num_actors}

    started = time.perf_counter()
    privacy = privacy_section(config, ledger, votes, answered)
    ledger.close()
    phases["privacy_analysis"] = time.perf_counter() - started

    final = curve[-1]
    metrics = {
        "student_accuracy": final["accuracy"],
        "label_accuracy": queried["label_accuracy"],  # released labels against the public pool's truth
        "queries_asked": queried["asked"],
        "queries_answered": queried["answered"],
        "budget_exhausted": queried["budget_exhausted"],
        "labels_per_second": queried["labels_per_second"],
        "teachers": teacher_summary,
        "curve": curve,
        "seconds": phases,
    }
    results.write_json("metrics", metrics)
    results.write_json("privacy", privacy)
    _plots(results, curve)

    summary = {
        "student_accuracy": round(final["accuracy"], 4),
        "label_accuracy": round(queried["label_accuracy"], 4),
        "queries_asked": queried["asked"],
        "queries_answered": queried["answered"],
        "epsilon": _epsilon_line(config, privacy),
    }
    return summary


def _query_with_progress(student, settings: StudentConfig, batches_per_call: int = 4) -> dict[str, Any]:
    """Let the student actor query in short stretches so the driver can show a progress bar."""
    import ray
    from tqdm import tqdm

    with tqdm(total=settings.queries, desc="student queries", unit="query") as bar:
        while True:
            state = ray.get(student.query.remote(settings.queries, settings.batch_size, settings.checkpoints,
                                                 progress=False, max_batches=batches_per_call))
            bar.update(state["asked"] - bar.n)
            if state["asked"] >= settings.queries or state["budget_exhausted"]:
                break
    ray.get(student.close.remote())
    return state


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

