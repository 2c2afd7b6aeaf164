"""The teacher/student configuration: typed sections, checked when built, with the defaults
that follow from the declared counts filled in (``TeacherStudentConfig.__post_init__``). Loading one needs
neither torch nor Ray."""
from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from conclave.cluster.owners import DataOwner, GatewaysConfig, check_behind_gateways, check_gateways, check_owners
from conclave.cluster.run_privacy import Aggregation, PrivacyConfig
from conclave.cluster.teaching.vote_source import VOTE_SOURCES, VoteSource, chosen
from conclave.errors import InvalidValue
from conclave.learning.data.features import check_features
from conclave.learning.data.sources import DataSource
from conclave.learning.embeddings import HogPCA, ScatteringPCA, check_embedding
from conclave.learning.label_propagation import LabelPropagationConfig
from conclave.learning.selection import QuerySelection
from conclave.learning.semi_supervised import FixMatchConfig
from conclave.learning.train_config import TrainConfig
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.report import planned_charge
from conclave.privacy.accounting.smooth_sensitivity import SmoothSensitivityParameters
from conclave.privacy.mechanisms import (MECHANISMS, ConfidentGNMax, SecureVoteMechanism, VoteMechanism,
                                         build_mechanism, secure_mechanism)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TeacherStudentData:
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
            raise InvalidValue(f"data.public_size must be >= 1, got {self.public_size}")
        if self.private_size is not None and self.private_size < 1:
            raise InvalidValue(f"data.private_size must be >= 1 or null, got {self.private_size}")


@dataclass(frozen=True)
class OwnerConfig(DataOwner):
    """A data owner (``cluster.owners.DataOwner``) and its ``teachers``, packed into its
    ``actors``. ``records``, if declared, is a public upper bound: each teacher keeps at most its
    share of it (``actors.owners.OwnerSource``); fewer records held is no error."""

    teachers: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.teachers < 1:
            raise InvalidValue(f"owner {self.name}: teachers must be >= 1")
        if self.records is not None and self.records < self.teachers:
            raise InvalidValue(f"owner {self.name}: {self.teachers} teachers need at least as many records "
                             f"(it declares {self.records})")


@dataclass(frozen=True)
class TeachersConfig:
    count: int | None = None  # TeacherStudentConfig fills it in: the owners' teachers summed, else DEFAULT_TEACHERS
    per_actor: int | None = None  # teachers packed per Ray actor (None: one actor per CPU)
    # A learning.models name, "module:function", or (through the library) the factory itself;
    # None: by the inputs (learning.models.default_model)
    model: str | Callable[..., Any] | None = None
    # learning's TrainConfig; its seed is replaced by the run's (``TeacherStudentConfig.seed``) where a model trains
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=60, batch_size=32, lr=3e-3))

    def __post_init__(self) -> None:
        if self.count is not None and self.count < 1:
            raise InvalidValue(f"teachers.count must be >= 1, got {self.count}")
        if self.per_actor is not None and self.per_actor < 1:
            raise InvalidValue(f"teachers.per_actor must be >= 1 or null, got {self.per_actor}")


DEFAULT_TEACHERS = 50  # without owners and without teachers.count


@dataclass(frozen=True)
class MechanismConfig:
    """A ``privacy.mechanisms.build_mechanism`` name and its parameters. What a mechanism lets a
    config leave out is filled from the votes per query (teachers, or k: the class's ``defaults``,
    e.g. Confident-GNMax's threshold), and what it is paired with in its vote source
    (``paired_with``: Private-kNN's ``sample_rate``, public clusters' ``votes_per_record``) comes
    from the ``knn`` or ``clusters`` section (``TeacherStudentConfig`` fills them in)."""

    name: str = ConfidentGNMax.name
    params: dict = field(default_factory=lambda: {"sigma1": 20.0, "sigma2": 12.0})

    def __post_init__(self) -> None:
        self.filled(1, {attr: 1 for attr in self.paired_with}).build()  # an unknown name or a bad parameter: now

    @property
    def paired_with(self) -> tuple[str, ...]:
        """The vote source's settings this mechanism's charge holds for (none for teachers' votes)."""
        return MECHANISMS[self.name].paired_with if self.name in MECHANISMS else ()

    def filled(self, votes: int, supplied: dict[str, float]) -> MechanismConfig:
        """This mechanism with what it left to the votes per query and to its vote source filled in."""
        params = dict(self.params)
        defaults = MECHANISMS[self.name].defaults(votes) if self.name in MECHANISMS else {}
        for key, value in defaults.items():
            if params.get(key) is None:
                params[key] = value
        for attr in self.paired_with:
            if params.get(attr) is None and attr in supplied:
                params[attr] = supplied[attr]
        return self if params == self.params else dataclasses.replace(self, params=params)

    def build(self) -> VoteMechanism:
        """A new mechanism of this name and these parameters (a factory: a run asks ``instance``)."""
        try:
            return build_mechanism(self.name, **self.params)
        except (KeyError, TypeError, ValueError) as err:
            raise InvalidValue(f"mechanism {self.name!r} with params {self.params}: {err}") from err

    @functools.cached_property
    def instance(self) -> VoteMechanism:
        """The run's mechanism, built once for this section: every check, plan and report reads this
        one, and it never answers (an aggregator answers with its own copy,
        ``TeacherStudentConfig.answering_mechanism``), so a stateful one's state stays unopened here."""
        return self.build()

    @functools.cached_property
    def secure_instance(self) -> SecureVoteMechanism:
        """``instance``'s variant over secure-sum vote totals (ValueError naming those that have one)."""
        return secure_mechanism(self.instance)


@dataclass(frozen=True)
class KnnConfig:
    """kNN votes over the owners' records instead of teachers (Private-kNN, Zhu et al. 2020;
    ``actors.knn_votes``): per query each record is in a Poisson sample at ``sample_rate`` and
    the ``k`` nearest sampled records vote, in a fixed public ``embedding``
    (``learning.embeddings``, fitted on the public pool only: ``dims`` PCA dimensions)."""

    k: int = 100
    sample_rate: float = 0.1
    # a learning.embeddings.EMBEDDINGS name, "network:PATH" (an earlier run's student.pt) or "package.module:function"
    embedding: str = ScatteringPCA.name
    dims: int = 64
    actors: int | None = None  # benchmark data: actors holding the records (None: one per CPU); owners: theirs

    def __post_init__(self) -> None:
        check_embedding(self.embedding, "knn.embedding")
        if self.k < 1 or self.dims < 1:
            raise InvalidValue(f"knn.k and knn.dims must be >= 1, got {self.k}, {self.dims}")
        if not 0 < self.sample_rate <= 1:
            raise InvalidValue(f"knn.sample_rate must be in (0, 1], got {self.sample_rate}")
        if self.actors is not None and self.actors < 1:
            raise InvalidValue(f"knn.actors must be >= 1 or null, got {self.actors}")


@dataclass(frozen=True)
class ClustersConfig:
    """Public-cluster votes over the owners' records instead of teachers (reverse kNN, Li et al.
    2022; ``actors.cluster_votes``): the student asks the medoids of ``count`` k-means clusters of
    the public pool in a fixed public ``embedding`` (``learning.embeddings``, fitted on the pool
    only) in ONE batch; each record votes, with its label, for its ``votes_per_record`` nearest
    medoids, and the batch is one release whatever ``count``. The medoids' labels then label the
    pool (post-processing): each its own cluster, or each pool input by its nearest answered
    medoids (``student.selection.spread_medoids``)."""

    count: int = 300
    votes_per_record: int = 3
    embedding: str = HogPCA.name
    dims: int = 50
    actors: int | None = None  # benchmark data: actors holding the records (None: one per two CPUs); owners: theirs

    def __post_init__(self) -> None:
        check_embedding(self.embedding, "clusters.embedding")
        if self.count < 1 or self.votes_per_record < 1 or self.dims < 1:
            raise InvalidValue(f"clusters.count, clusters.votes_per_record and clusters.dims must be >= 1, got "
                             f"{self.count}, {self.votes_per_record}, {self.dims}")
        if self.actors is not None and self.actors < 1:
            raise InvalidValue(f"clusters.actors must be >= 1 or null, got {self.actors}")


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
            raise InvalidValue("estimates: order, beta and sigma_ss go together (or none, for the defaults)")
        if all(v is not None for v in fixed):
            SmoothSensitivityParameters(*fixed)  # a bad value is a config error now

    def parameters(self, mechanism, queries: int, delta: float) -> SmoothSensitivityParameters | None:
        """The release's parameters, from public settings only (None when off or not applicable)."""
        if not self.smooth_sensitivity or not mechanism.smooth_sensitivity_analysis:
            return None
        if self.order is not None:
            return SmoothSensitivityParameters(self.order, self.beta, self.sigma_ss)
        return SmoothSensitivityParameters.for_workload(mechanism.run_charge(queries, queries), delta)


@dataclass(frozen=True)
class StudentConfig:
    queries: int = 300  # inputs of the public pool asked, in pool order
    batch_size: int = 50  # inputs per gRPC call
    checkpoints: tuple[int, ...] = (50, 100, 200)  # also train+evaluate after this many asked
    model: str | Callable[..., Any] | None = None  # as teachers.model; None: the teachers'
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=40, batch_size=32, lr=3e-3))
    # Self-training on the rest of the public pool (free post-processing; actors/student.py):
    # the student's own predictions at least this confident become extra labels. null: off.
    pseudo_label_threshold: float | None = None
    # FixMatch on the whole pool (learning.semi_supervised; free post-processing). null: off.
    semi_supervised: FixMatchConfig | None = None
    # Spread the answers over a kNN graph of the pool (learning.label_propagation; free post-
    # processing): its confident labels join the answered ones, also as FixMatch's labelled set. null: off.
    label_propagation: LabelPropagationConfig | None = None
    # Which pool inputs to ask about: the pool in order, or rounds of an active-learning strategy.
    selection: QuerySelection = field(default_factory=QuerySelection)
    # Students trained alike from consecutive seeds, answering with their averaged probabilities
    # (learning.models.averaged; free post-processing, each member costs one student's training).
    members: int = 1
    # Each test prediction averages the image and this many weakly shifted views of it
    # (learning.view_averaging; free post-processing of the trained student, images only). 0: off.
    test_views: int = 0

    def __post_init__(self) -> None:
        if self.pseudo_label_threshold is not None and self.semi_supervised is not None:
            raise InvalidValue("student: choose pseudo_label_threshold (self-training) or semi_supervised (FixMatch)")
        if self.pseudo_label_threshold is not None and self.label_propagation is not None:
            raise InvalidValue("student: choose pseudo_label_threshold (self-training) or label_propagation")
        if self.pseudo_label_threshold is not None and not 0 < self.pseudo_label_threshold <= 1:
            raise InvalidValue(f"student.pseudo_label_threshold must be in (0, 1] or null, "
                             f"got {self.pseudo_label_threshold}")
        if self.queries < 1 or self.batch_size < 1:
            raise InvalidValue(f"student.queries and student.batch_size must be >= 1, got "
                             f"{self.queries}, {self.batch_size}")
        if self.members < 1:
            raise InvalidValue(f"student.members must be >= 1, got {self.members}")
        if self.test_views < 0:
            raise InvalidValue(f"student.test_views must be >= 0, got {self.test_views}")
        if any(c < 1 for c in self.checkpoints):
            raise InvalidValue(f"student.checkpoints must be positive, got {list(self.checkpoints)}")


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
            raise InvalidValue(f"server.port must be in [0, 65535], got {self.port}")
        if self.max_batch < 1:
            raise InvalidValue(f"server.max_batch must be >= 1, got {self.max_batch}")


# The demo's student: typical inputs first (k-means centres of the pool), its answers spread over
# the pool by label propagation, then FixMatch (measured on digits: issue 27's closing note).
DEFAULT_STUDENT = StudentConfig(batch_size=20, semi_supervised=FixMatchConfig(epochs=60, batch_size=32, threshold=0.9),
                                label_propagation=LabelPropagationConfig(),
                                selection=QuerySelection(cold_start="kmeans"))
# For table inputs FixMatch (image augmentations) does not apply: self-training instead.
DEFAULT_TABLE_STUDENT = dataclasses.replace(DEFAULT_STUDENT, semi_supervised=None, pseudo_label_threshold=0.9,
                                            label_propagation=None)


AGGREGATIONS = (Aggregation.TRUSTED_AGGREGATOR, Aggregation.SECURE)  # who may add up the votes
# The mechanism of a config with owners that names none: Confident-GNMax, both rounds at one σ (the
# owners' gateways admit one σ for every round of a run).
OWNERS_MECHANISM = MechanismConfig(params={"sigma1": 20.0, "sigma2": 20.0})


@dataclass(frozen=True)
class TeacherStudentConfig:
    name: str = "teacher-student"
    seed: int = 0
    data: TeacherStudentData = field(default_factory=TeacherStudentData)
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
    # kNN votes over the owners' records instead of teachers (the teachers section is then unused).
    knn: KnnConfig | None = None
    # Public-cluster votes over the owners' records instead of teachers (the student asks cluster medoids).
    clusters: ClustersConfig | None = None
    # Who sees the votes: "trusted-aggregator" (PATE's classic trust: the aggregator adds clean
    # histograms) or "secure" (they meet only in the secure sum with distributed Skellam noise:
    # privacy/secure_votes.py, docs/privacy.md "Who sees what"; gnmax and confident-gnmax). None:
    # secure with owners (who vote behind their gateways), else trusted-aggregator.
    aggregation: Aggregation | None = None
    # The coordinator's certificates for owners named by their gateway (``owners: [{name, gateway}]``).
    gateways: GatewaysConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "aggregation", _aggregation(self))
        if self.owners:
            _check_owners(self)
            if self.mechanism == MechanismConfig():  # left out: the gateways admit one σ for every round
                object.__setattr__(self, "mechanism", OWNERS_MECHANISM)
        elif self.public is not None or self.test is not None or self.classes is not None:
            raise InvalidValue("public, test and classes go with owners (or use the data section alone)")
        # What the config left to the declared counts, filled in once (so config.json says it).
        count = self.num_teachers if self.owners else (self.teachers.count or DEFAULT_TEACHERS)
        object.__setattr__(self, "teachers", dataclasses.replace(self.teachers, count=count))
        source = self.vote_source
        object.__setattr__(self, "mechanism", self.mechanism.filled(source.votes_per_query(self), source.supplies()))
        _check_votes(self)
        object.__setattr__(self, "student", source.asked(self))
        if not self.owners and self.student.queries > self.data.public_size:
            raise InvalidValue(f"student.queries ({self.student.queries}) exceeds the public pool "
                             f"(data.public_size = {self.data.public_size})")
        if self.student.batch_size > self.server.max_batch:
            raise InvalidValue(f"student.batch_size ({self.student.batch_size}) exceeds "
                             f"server.max_batch ({self.server.max_batch})")
        if not self.mechanism.instance.describe().bounded and self.privacy.budget is not None:
            raise InvalidValue(f"mechanism {self.mechanism.name} has no finite DP guarantee, so no budget can gate "
                             "it: set privacy.budget to null (the run records its spend and reports it unbounded)")
        _check_aggregation(self)
        _check_gateways(self)
        self.privacy.budget_filter(self.planned())  # a budget too small for any order is a config error now

    @functools.cached_property
    def vote_source(self) -> VoteSource[TeacherStudentConfig]:
        """What votes (``cluster.teaching.VOTE_SOURCES``): the source whose section is set, else teachers."""
        return chosen(self)

    @property
    def through_gateways(self) -> bool:
        """Whether the owners are named by their gateways (never their files); owners named by their data
        vote behind gateways the run starts on this machine (``cluster.gateway.local``)."""
        return self.gateways is not None

    @property
    def records_vote(self) -> KnnConfig | ClustersConfig | None:
        """The section in which the owners' records vote themselves, if any."""
        return self.vote_source.section if self.vote_source.records_vote else None

    @property
    def vote_lemma(self) -> str:
        """Why one record moves what the charges assume: disjoint shards, kNN, or public clusters."""
        return self.vote_source.lemma

    @property
    def models(self) -> tuple[str | Callable[..., Any] | None, ...]:
        """The models this run builds (None: chosen by the inputs, a built-in one)."""
        return self.teachers.model, self.student.model

    @property
    def num_teachers(self) -> int:
        return sum(owner.teachers for owner in self.owners) if self.owners else self.teachers.count

    @property
    def secure(self) -> bool:
        return self.aggregation == Aggregation.SECURE

    @property
    def vote_mechanism(self) -> VoteMechanism | SecureVoteMechanism:
        """What the aggregator runs: the configured mechanism (``MechanismConfig.instance``), or with
        ``aggregation: secure`` its variant over secure-sum vote totals (ValueError naming the
        mechanisms that have one). The run's one object: plans and reports read it, none answers."""
        return self.mechanism.secure_instance if self.secure else self.mechanism.instance

    def answering_mechanism(self) -> VoteMechanism | SecureVoteMechanism:
        """A fresh copy of ``vote_mechanism`` for one answering aggregator: a stateful mechanism's
        state (the stability mechanism's) is that aggregator's alone, and advances only when its
        ledger accepted a charge; the run's own object stays unopened for the plan and the report."""
        return dataclasses.replace(self.vote_mechanism)

    def smooth_sensitivity(self) -> SmoothSensitivityParameters | None:
        return self.estimates.parameters(self.mechanism.instance, self.student.queries, self.privacy.delta)

    def planned(self, answers: int | None = None) -> PrivacyCharge:
        """The worst case of the planned work, on add/remove neighbours of the owners' records:
        ``answers`` queries answered (default: every one of ``student.queries``), plus the
        smooth-sensitivity release if asked (fixed by ``student.queries``)."""
        answered = self.student.queries if answers is None else answers
        planned = planned_charge(self.vote_mechanism, answered, self.smooth_sensitivity(),
                                 batch_size=self.student.batch_size)
        # Records that vote themselves are charged at record level already; teachers' mechanisms per vote.
        if planned.neighbouring == Neighbouring.ADD_REMOVE:
            return planned
        return planned.for_records(Neighbouring.ADD_REMOVE, self.vote_lemma)


def _aggregation(config: TeacherStudentConfig) -> Aggregation:
    """``config.aggregation`` as an ``Aggregation`` (as read from YAML): left out, secure with owners."""
    aggregation = config.aggregation
    if aggregation is None:
        aggregation = Aggregation.SECURE if config.owners else Aggregation.TRUSTED_AGGREGATOR
    if aggregation not in AGGREGATIONS:
        raise InvalidValue(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")
    aggregation = Aggregation(aggregation)
    if config.owners and aggregation != Aggregation.SECURE:
        raise InvalidValue("owners vote behind their gateways, in secure rounds (only a masked share of each "
                         "owner's noised votes leaves it): set aggregation: secure, or leave it out")
    return aggregation


def _check_aggregation(config: TeacherStudentConfig) -> None:
    """With ``aggregation: secure``: a mechanism with a secure variant, no analysis of clean votes."""
    if config.secure:
        config.vote_mechanism  # a mechanism without a secure variant is refused now, in one line
        if config.estimates.smooth_sensitivity:
            raise InvalidValue("estimates.smooth_sensitivity analyses the clean votes, which aggregation: secure "
                             "never shows the aggregator: turn it off")


def _check_gateways(config: TeacherStudentConfig) -> None:
    """Owners vote behind their gateways (their own, or those the run starts on this machine for
    owners named by their data), with what the source needs there."""
    check_gateways(config.owners, config.gateways)
    if config.owners:
        config.vote_source.check_gateway(config)


def _check_votes(config: TeacherStudentConfig) -> None:
    """The vote source and the mechanism charged for it go together, at one setting; across
    owners, records that vote themselves meet only in the secure sum."""
    source = config.vote_source
    supplied = source.supplies()
    for attr in config.mechanism.paired_with:
        if attr not in supplied:
            sections = [kind for kind, cls in VOTE_SOURCES.items() if attr in cls.paired]
            raise InvalidValue(f"mechanism {config.mechanism.name} is charged for votes with its {attr}: add a "
                             f"{' or '.join(sections)} section")
        if config.mechanism.params[attr] != supplied[attr]:
            raise InvalidValue(f"mechanism {config.mechanism.name} has {attr} {config.mechanism.params[attr]:g} but "
                               f"the vote source's is {supplied[attr]:g}: leave the mechanism's {attr} out (the "
                               "section sets it)")
    source.check(config)
    if not source.records_vote:
        return
    if config.estimates.smooth_sensitivity:
        raise InvalidValue(f"estimates.smooth_sensitivity is not analysed for {source.kind} votes: turn it off")


def _check_owners(config: TeacherStudentConfig) -> None:
    """Owners' data, said by their sources and read behind their gateways: no data section, no other count."""
    check_owners(config.owners, config.test, config.classes, config.public)
    check_behind_gateways(config.owners)
    if config.data != TeacherStudentData():
        raise InvalidValue("with owners, leave the data section out: the sources say the data, and each owner's "
                         "gateway reads its records as they are (no data.features)")
    if config.teachers.count not in (None, config.num_teachers):
        # Replaced, not refused: a config rebuilt with other owners (dataclasses.replace) still
        # carries the count derived from the old ones.
        log.warning("teachers.count %d is replaced by the owners' %d teachers (with owners it is their sum: "
                    "leave it out)", config.teachers.count, config.num_teachers)
