"""Private active learning (Zhao et al. 2019): a DP-SGD checkpoint, improved with bought labels.

DP-SGD on private shards held by Ray actors (``actors.dp_trainer``), charged before training;
then each strategy buys public labels and fine-tunes (free). NearPrivate starts from the latest
earlier checkpoint whose composed ε stays under the final one's, so every model compared carries
the same guarantee. With owners, each step is a secure sum of their gateways' shares, charged at
each owner's gateway first (``cluster.active_gateways``): their own gateways, or those the run
starts on this machine for owners named by their data (``cluster.gateway.local``).
``learn_actively`` returns an ``ActiveLearningResult``; docs/active-learning.md.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from conclave.cluster.config import as_base
from conclave.cluster.owners import (DataOwner, GatewaysConfig, PublicData, check_behind_gateways, check_gateways,
                                     check_owner_columns, check_owners)
from conclave.cluster.results import RunDirectory
from conclave.cluster.run_privacy import PrivacyConfig, RunPrivacy, dp_sgd_trust
from conclave.errors import InvalidValue
from conclave.learning.data.features import check_features
from conclave.learning.data.sources import DataSource, PublicReading
from conclave.learning.dp_schedule import DPSGDConfig
from conclave.learning.train_config import TrainConfig
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.guarantee import Guarantee, worst_case_guarantee
from conclave.privacy.accounting.ledger import ChargeGate, Ledger, PrivacyLedger
from conclave.privacy.accounting.rdp import sum_charges

if TYPE_CHECKING:
    from conclave.cluster.active_gateways import GatewayOwners

log = logging.getLogger(__name__)

STRATEGY_NAMES = ("random", "entropy", "margin", "diverse_public", "near_private")


@dataclass(frozen=True)
class ActiveLearningData:
    name: str = "digits"  # digits | mnist | ... (see learning.data)
    root: str | None = None  # directory of the files (not needed for digits)
    private_size: int = 900  # seeded subset of the training set; the rest is the public pool
    public_size: int | None = None  # keep only this many public points (None: all the rest)
    num_shards: int = 2  # private shards (one shard actor each with dpsgd.distributed)
    pollution: float = 0.0  # add this fraction (of the public pool) of out-of-domain images
    features: str | None = None  # a fixed representation, e.g. scattering (learning.data.features)

    def __post_init__(self) -> None:
        check_features(self.features, "data.features")
        if self.private_size < 1 or self.num_shards < 1:
            raise InvalidValue("data.private_size and data.num_shards must be >= 1")
        if self.public_size is not None and self.public_size < 1:
            raise InvalidValue(f"data.public_size must be >= 1 or null, got {self.public_size}")
        if not 0 <= self.pollution <= 1:
            raise InvalidValue(f"data.pollution must be in [0, 1], got {self.pollution}")


DEFAULT_NOISE_MULTIPLIER = 1.1  # σ where a config gives neither σ nor a target ε


@dataclass(frozen=True)
class ActiveLearningDPSGD(DPSGDConfig):
    """learning's ``DPSGDConfig`` with this pipeline's defaults (``batch_size`` is the expected
    Poisson batch over the union of the shards), plus how the shards are trained. δ is the
    run's ``privacy.delta``, not a key here: ``dp_config`` puts it in."""

    epochs: int = 10
    lr: float = 0.5
    noise_multiplier: float | None = None  # DEFAULT_NOISE_MULTIPLIER unless target_epsilon is given
    # A placeholder that passes DPSGDConfig's checks: train and price with ``dp_config(delta)``.
    delta: float = field(default=1e-5, init=False)
    # Data-parallel over one actor per shard (else one actor holds and trains them all).
    # With owners it is always a secure sum over the owners' gateways.
    distributed: bool = False
    cpus_per_worker: float = 1.0  # per shard actor (capped so that all fit in the cluster at once)
    # DP column screening (tables through the owners' gateways): first a run of this many steps of
    # logistic regression at the same q and σ, charged like the steps; the model then reads only the
    # columns whose weight norm is at least ``screen_keep`` of the largest (post-processing). 0: off.
    screen_steps: int = 0
    screen_keep: float = 0.35

    def __post_init__(self) -> None:
        if self.noise_multiplier is None and self.target_epsilon is None:  # a target alone sets σ
            object.__setattr__(self, "noise_multiplier", DEFAULT_NOISE_MULTIPLIER)
        super().__post_init__()
        if self.distributed and self.grad_sample_mode not in ("auto", "hooks"):
            raise InvalidValue("dpsgd.distributed trains with Opacus's hooks: set grad_sample_mode: hooks")
        if self.screen_steps < 0:
            raise InvalidValue(f"dpsgd.screen_steps must be >= 0 (0: no screening), got {self.screen_steps}")
        if not 0 < self.screen_keep <= 1:
            raise InvalidValue(f"dpsgd.screen_keep must be in (0, 1], got {self.screen_keep}")

    def dp_config(self, delta: float) -> DPSGDConfig:
        """The DP-SGD run this section describes, at the run's δ."""
        return as_base(self, DPSGDConfig, delta=delta)


@dataclass(frozen=True)
class SelectionConfig:
    """Which strategies buy public labels, and how many. ``strategies: []``: none are bought, the
    DP-SGD model is the result (``conclave plan --propose`` proposes this for tables)."""

    strategies: tuple[str, ...] = STRATEGY_NAMES
    sizes: tuple[int, ...] = (50, 100, 200)  # N_labeled values
    components: int = 16  # p, for DiversePublic's PCA and NearPrivate's DP-PCA
    n_each: int = 10  # DiversePublic: labels per cluster (N_cluster = N / n_each)
    uncertain_factor: float = 2.0  # k = factor × N
    epsilon_pca: float = 0.3  # NearPrivate: ε_dpPCA (Analyze Gauss, at the run's δ)
    epsilon_support: float = 0.7  # NearPrivate: ε of the Laplace noisy counts
    near_private_epoch: int | None = None  # None: latest checkpoint matching the final one's ε

    def __post_init__(self) -> None:
        unknown = sorted(set(self.strategies) - set(STRATEGY_NAMES))
        if unknown:
            raise InvalidValue(f"selection.strategies: unknown {unknown}; choose from {list(STRATEGY_NAMES)}")
        if not self.sizes or min(self.sizes) < 1:
            raise InvalidValue("selection.sizes must be a non-empty list of positive label budgets")
        if self.epsilon_pca <= 0 or self.epsilon_support <= 0:
            raise InvalidValue("selection.epsilon_pca and selection.epsilon_support must be > 0")


@dataclass(frozen=True)
class FinetuneConfig(TrainConfig):
    """Plain (non-private) fine-tuning on the bought public labels: learning's ``TrainConfig``
    with this section's defaults, plus ``replay``; its seed is the run's (``train_config``).

    ``replay``: that many other public points, labelled by the starting DP checkpoint's own
    predictions, are mixed in (the same draw for every strategy at a given budget). This is
    post-processing of a DP model on public inputs, so it costs no privacy; it keeps a small,
    class-skewed set of bought labels (what uncertainty sampling picks) from making the model
    forget the classes it already knew. 0 = fine-tune on the bought labels alone, as in the paper.
    """

    epochs: int = 10
    batch_size: int = 32
    seed: int = field(default=0, init=False)  # not a key: the run's seed
    replay: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.epochs < 1 or self.replay < 0:
            raise InvalidValue("finetune: epochs must be >= 1 and replay >= 0")

    def train_config(self, seed: int) -> TrainConfig:
        """How each model is fine-tuned, with the run's seed."""
        return as_base(self, TrainConfig, seed=seed)


@dataclass(frozen=True)
class AnnotatorConfig:
    """Who labels the bought points. "oracle" reveals the pool's true labels (a human
    annotator). "aggregator" asks a running teacher-ensemble aggregator (``conclave serve``)
    over gRPC; its privacy cost is charged to the aggregator's own ledger and reported beside
    this run's (if its teachers saw the same private data, the two ε's compose)."""

    kind: Literal["oracle", "aggregator"] = "oracle"
    address: str | None = None  # host:port of the aggregator
    token_env: str | None = None  # environment variable holding its bearer token (not the token)
    root_cert: str | None = None  # PEM file when the aggregator speaks TLS
    batch: int = 512  # inputs per Label call (at most the server's max_batch)

    def __post_init__(self) -> None:
        if self.kind == "aggregator" and not self.address:
            raise InvalidValue("annotator.address is required when annotator.kind is aggregator")
        if self.batch < 1:
            raise InvalidValue(f"annotator.batch must be >= 1, got {self.batch}")


@dataclass(frozen=True)
class ActiveLearningConfig:
    name: str = "active-digits"
    model: str | None = None  # None: by the inputs (see learning.models.default_model)
    data: ActiveLearningData = field(default_factory=ActiveLearningData)
    dpsgd: ActiveLearningDPSGD = field(default_factory=ActiveLearningDPSGD)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    annotator: AnnotatorConfig = field(default_factory=AnnotatorConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)  # default: no budget, the planned worst case
    checkpoints_from: str | None = None  # reuse an earlier run's DP checkpoints (its results folder)
    seed: int = 0
    torch_threads: int = 1
    # Owners' own data (instead of the data section's benchmark): each owner's source is read
    # only behind its gateway; every owner declares its ``records``.
    owners: tuple[DataOwner, ...] = ()
    public: DataSource | None = None  # the pool (labels: only for the oracle annotator), read by the driver
    test: DataSource | None = None  # labelled public test data, read by the driver
    classes: tuple[str, ...] | None = None  # the label names, in class order (None: the test data's)
    # Ray's runtime_env for the run's workers; a model of your own is added to its py_modules by the run.
    runtime_env: dict = field(default_factory=dict)
    # The coordinator's certificates for owners named by their gateway (``owners: [{name, gateway}]``):
    # DP-SGD then runs as steps at the owners' gateways (``cluster.active_gateways``).
    gateways: GatewaysConfig | None = None

    def __post_init__(self) -> None:
        if not self.owners:
            if self.public is not None or self.test is not None or self.classes is not None:
                raise InvalidValue("public, test and classes go with owners (or use the data section alone)")
            if self.dpsgd.screen_steps:
                raise InvalidValue("dpsgd.screen_steps: screening runs at the owners' gateways, on their tables; "
                                   "name owners (or set it to 0)")
            check_gateways(self.owners, self.gateways)
            return
        check_gateways(self.owners, self.gateways)
        check_owners(self.owners, self.test, self.classes, self.public)
        check_behind_gateways(self.owners)
        self._check_gateways()
        allowed = ActiveLearningData(public_size=self.data.public_size)
        if self.data != allowed:
            raise InvalidValue("with owners, the data section may only set public_size (the sources say the rest)")

    def _check_gateways(self) -> None:
        """DP-SGD at the owners' gateways: on the owners' records as they are, noise from OS entropy, and
        only releases a gateway has a call for (the model, a registered one by name, is checked with the
        public data: ``validate``)."""
        if self.checkpoints_from is not None:
            raise InvalidValue("checkpoints_from: owners named by their gateway train there; reuse no checkpoints")
        if self.data.features is not None:
            raise InvalidValue("data.features: a gateway reads its owner's records as they are; leave it out")
        if self.privacy.insecure_noise_seed is not None:
            raise InvalidValue("privacy.insecure_noise_seed: the gateways draw noise from OS entropy only; remove it")

    @property
    def through_gateways(self) -> bool:
        """Whether the owners are named by their gateways (never their files); owners named by their
        data train behind gateways the run starts on this machine (``cluster.gateway.local``)."""
        return self.gateways is not None

    @property
    def models(self) -> tuple[str | None, ...]:
        """The model this run builds (None: chosen by the inputs, a built-in one)."""
        return (self.model,)

    @property
    def private_size(self) -> int:
        """The private records DP-SGD's schedule is computed from: declared, never counted. Owners
        behind gateways declare theirs there (``active_gateways.declared_records``)."""
        if self.through_gateways:
            raise InvalidValue("owners named by their gateway declare their records there, not in the config")
        return sum(owner.records for owner in self.owners) if self.owners else self.data.private_size

    @property
    def buys_labels(self) -> bool:
        """Whether strategies buy public labels after DP-SGD (else the DP model is the result)."""
        return bool(self.selection.strategies)

    @property
    def secure_training(self) -> bool:
        """Whether DP-SGD sums across several shard actors or the owners' gateways, through the secure sum."""
        if self.owners:
            return True
        return self.dpsgd.distributed and self.data.num_shards > 1

    def selection_releases(self) -> list:
        """NearPrivate's two releases (DP-PCA, noisy counts) when it runs, else none: through
        secure sums with Skellam noise when several shard actors hold the private data, else
        noised by the one actor (Gaussian, discrete Laplace). Each is calibrated to its ε at
        the run's δ, and its ``charge()`` is what the ledger is charged when it runs."""
        from conclave.privacy.counts import LaplaceCounts, SkellamCounts
        from conclave.privacy.pca import AnalyzeGauss, SecureAnalyzeGauss

        sel, delta = self.selection, self.privacy.delta
        if "near_private" not in sel.strategies:
            return []
        if self.secure_training:
            return [SecureAnalyzeGauss(sel.epsilon_pca, delta), SkellamCounts(sel.epsilon_support, delta)]
        return [AnalyzeGauss(sel.epsilon_pca, delta), LaplaceCounts(sel.epsilon_support)]

    def planned(self, training: PrivacyCharge) -> PrivacyCharge:
        """The worst case of the planned work: the DP-SGD run ``training`` plus NearPrivate's releases."""
        return sum_charges([training, *(release.charge() for release in self.selection_releases())], label="planned")


# ---- out-of-domain images for the pollution experiment --------------------------------


def pollute(public, fraction: float, rng: np.random.Generator):
    """``public`` plus ⌈fraction·n⌉ out-of-domain images, in thirds: inverted digits (an
    annotator would still name the digit), uniform noise and random strokes (an annotator can
    only guess: uniform random labels). Returns (dataset, bool mask of the added images)."""
    from conclave.learning.data import Dataset

    count = math.ceil(fraction * len(public))
    if count == 0:
        return public, np.zeros(len(public), dtype=bool)
    kinds = np.arange(count) % 3
    _, channels, height, width = public.x.shape
    images = np.zeros((count, channels, height, width), dtype=np.float32)
    labels = rng.integers(public.num_classes, size=count)
    source = rng.integers(len(public), size=count)
    inverted = kinds == 0
    images[inverted] = 1.0 - public.x[source[inverted]]
    labels[inverted] = public.y[source[inverted]]
    images[kinds == 1] = rng.random((int(np.sum(kinds == 1)), channels, height, width))
    for i in np.flatnonzero(kinds == 2):
        for _ in range(3):  # three random line segments
            (r0, c0), (r1, c1) = rng.random((2, 2)) * [height - 1, width - 1]
            t = np.linspace(0, 1, 2 * max(height, width))
            images[i, :, np.round(r0 + t * (r1 - r0)).astype(int), np.round(c0 + t * (c1 - c0)).astype(int)] = 1.0
    polluted = Dataset(np.concatenate([public.x, images]), np.concatenate([public.y, labels.astype(np.int64)]),
                       public.num_classes, f"{public.name}+ood")
    return polluted, np.concatenate([np.zeros(len(public), dtype=bool), np.ones(count, dtype=bool)])


def aggregator_annotator(inputs: np.ndarray, client, batch: int = 512):
    """A ``CallableAnnotator`` whose labels come from an aggregator client, ``batch`` inputs per
    call (-1 where the aggregator abstains). Asking again for an input costs nothing: the
    aggregator answers repeats from its cache."""
    from conclave.learning.annotation import CallableAnnotator

    def label(x: np.ndarray) -> np.ndarray:
        parts = [client.label(x[i:i + batch]) for i in range(0, len(x), batch)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    return CallableAnnotator(inputs, label)


# ---- the run --------------------------------------------------------------------------


@dataclass
class PublicSide:
    """What the driver holds: the public pool (labels behind ``annotator``) with its
    out-of-domain mask, and the test split — both in the models' representation
    (``data.features``) — the pool's raw inputs for annotators that look at them, the class
    list, and for tables the pool's column statistics and names (owners' tables are read by them)."""

    pool_images: np.ndarray
    pool_inputs: np.ndarray
    annotator: Any
    out_of_domain: np.ndarray
    test: Any
    classes: tuple[str, ...]
    standardiser: Any = None
    columns: tuple[str, ...] | None = None

    @property
    def reading(self) -> PublicReading:
        """How owners' data is read: a table by the pool's columns with its column means in an
        unusable cell, an image folder at the pool's images' (height, width)."""
        size = (self.pool_images.shape[-2], self.pool_images.shape[-1]) if self.pool_images.ndim == 4 else None
        fill = None if self.standardiser is None else tuple(self.standardiser.mean.tolist())
        return PublicReading(self.columns, size, fill)

    def model_spec(self, config: ActiveLearningConfig):
        """The network every holder builds, sized for these inputs."""
        from conclave.actors.dp_trainer import ModelSpec
        from conclave.learning.models import default_model

        shape = self.test.input_shape
        kind = "table" if len(shape) == 1 else "image"
        name = config.model or ("scatternet_cnn" if config.data.features else default_model(shape, kind))
        channels, side = (shape[0], shape[-1]) if kind == "image" else (1, None)
        return ModelSpec(name, self.test.num_classes, channels, seed=config.seed, input_size=side,
                         input_shape=shape, standardiser=self.standardiser)


def public_side(config: ActiveLearningConfig, rng: np.random.Generator) -> PublicSide:
    """The public pool and test split: the ``public`` and ``test`` sources with owners, else
    those of ``config.data``'s benchmark (whose files hold the private part too: the driver
    reads them but keeps only the public rest)."""
    from conclave.learning.annotation import hide_labels, split_private_public
    from conclave.learning.data import load_dataset
    from conclave.learning.data.features import apply_features

    data = config.data
    if config.owners:
        read = PublicData.read(config.public, config.test, config.classes)
        public, test, classes, standardiser = read.splits.public, read.splits.test, read.classes, read.standardiser
        columns = read.schema.columns
        if public.unlabeled and config.annotator.kind == "oracle" and config.buys_labels:
            raise InvalidValue("public: the oracle annotator reveals the pool's labels, and it has none; name its "
                             "label, or label with a running aggregator (annotator.kind: aggregator)")
    else:
        train, test = load_dataset(data.name, data.root)
        _, public = split_private_public(train, data.private_size, config.seed)
        classes, standardiser, columns = tuple(str(c) for c in range(test.num_classes)), None, None
    if data.public_size is not None:
        public = public.subset(np.arange(min(data.public_size, len(public))))
    public, out_of_domain = pollute(public, data.pollution, rng)  # images first, then features
    pool_inputs, annotator = hide_labels(apply_features(public, data.features, progress=True))
    return PublicSide(public.x, pool_inputs, annotator, out_of_domain, apply_features(test, data.features),
                      classes, standardiser, columns)


def validate(config: ActiveLearningConfig) -> ActiveLearningConfig:
    """What the driver can check before Ray starts (one-line ``ConfigError``): the public
    data, the label budgets against the pool, the model against the model contract for these
    inputs (``check_model``)."""
    from conclave.cluster.config import ConfigError

    try:
        if config.owners:
            check_registered(config.model)
            public = public_side(config, np.random.default_rng(config.seed))
            if config.buys_labels and max(config.selection.sizes) > len(public.pool_inputs):
                raise InvalidValue(f"selection.sizes go up to {max(config.selection.sizes)} but the public pool has "
                                 f"{len(public.pool_inputs)} points")
        elif config.model is None:
            return config  # a benchmark's files are known, and so is the model its inputs choose
        else:
            inputs = benchmark_inputs(config)  # its pool is checked when the run reads it
    except (ValueError, OSError) as err:
        raise ConfigError(f"{'public/test' if config.owners else 'data'}: {err}") from err
    if config.owners:
        check_owner_columns(config.owners, public.reading)
        spec = public.model_spec(config)
        check_model(spec.name, spec.input_shape, spec.num_classes, spec.standardiser)
        if config.dpsgd.screen_steps and spec.standardiser is None:
            raise ConfigError("dpsgd.screen_steps: screening keeps a table's columns, and these inputs are images "
                              "(set it to 0)")
    else:
        check_model(config.model, *inputs)
    return config


def check_registered(model: str | None) -> None:
    """Owners train behind their gateways, which run no code a config names: a registered model by name
    (None: the inputs' default, a registered one), else ``ValueError``."""
    from conclave.learning.models.registry import REGISTRY

    if model is not None and model not in REGISTRY:
        raise InvalidValue(f"model {model!r}: DP-SGD behind gateways trains a registered model (a gateway runs no code "
                         "a config names)")


def benchmark_inputs(config: ActiveLearningConfig) -> tuple[tuple[int, ...], int]:
    """(one input's shape, number of classes) of the ``data`` section's benchmark, as the model
    sees them (after ``data.features``)."""
    from conclave.learning.data import load_dataset
    from conclave.learning.data.features import features_of

    _, test = load_dataset(config.data.name, config.data.root)
    shape = tuple(test.input_shape)
    if config.data.features:  # a fixed transform: its output shape follows from the image shape alone
        shape = features_of(np.zeros((1, *shape), dtype=np.float32), config.data.features).shape[1:]
    return shape, test.num_classes


def check_model(name: str, input_shape: tuple[int, ...], num_classes: int, standardiser=None) -> None:
    """The run's model against the contract (``learning.models.contract``): DP-SGD trains it
    and every strategy embeds the public pool with its ``.features``."""
    from conclave.cluster.config import ConfigError
    from conclave.learning.models import check_model as check

    try:
        check(name, num_classes, input_shape, dp_sgd=True, standardiser=standardiser,
              parts={"features": "active learning embeds the public pool with (every strategy's PublicPool)"})
    except ValueError as err:
        raise ConfigError(f"model: {err}") from None


def planned_work(config: ActiveLearningConfig, records: int | None = None) -> PrivacyCharge:
    """The DP-SGD schedule of the declared private size (``records``: what the owners' gateways
    declare; None: the config's) with its screening steps, or the reused checkpoints' cost, plus
    NearPrivate's releases."""
    from conclave.learning.dp_schedule import dp_schedule

    reused = _reused_checkpoints(config)
    training = reused[-1].charge() if reused else dp_schedule(
        config.private_size if records is None else records, config.dpsgd.dp_config(config.privacy.delta),
        secure=config.secure_training, screen_steps=config.dpsgd.screen_steps).whole_charge
    return config.planned(training)


def shard_plans(config: ActiveLearningConfig) -> list:
    """Where the benchmark's private shards are held: on one actor per shard (``dpsgd.distributed``) or all
    on one (owners' records stay behind their gateways)."""
    from conclave.actors.dp_trainer import PrivateSource, ShardPlan

    data = config.data
    source = PrivateSource(data.name, data.root, data.private_size, data.num_shards, config.seed, data.features)
    if config.dpsgd.distributed:
        return [ShardPlan(source, (i,)) for i in range(data.num_shards)]
    return [ShardPlan(source, tuple(range(data.num_shards)))]


class PrivateShards:
    """The benchmark's shard actors, started the first time they are needed (to train, or for
    NearPrivate's sums when the checkpoints are reused) and kept for the rest of the run."""

    def __init__(self, config: ActiveLearningConfig, spec) -> None:
        self._config, self._spec = config, spec
        self._group = None

    @property
    def group(self):
        from conclave.actors.dp_trainer import ShardGroup

        if self._group is None:
            plans = shard_plans(self._config)
            self._group = ShardGroup(plans, self._spec, self._config.torch_threads,
                                     num_cpus=self._config.dpsgd.cpus_per_worker,
                                     input_shape=self._spec.input_shape)
        return self._group

    @property
    def nodes(self) -> dict[str, list[str]]:
        return {} if self._group is None else self._group.placement

    def support(self, checkpoint, releases: Sequence, gate: ChargeGate):
        """NearPrivate's ``releases`` over the shard actors under ``checkpoint``, charged to ``gate``."""
        group = self.group
        if group.secure != self._config.secure_training:
            raise RuntimeError("the shard actors' way of summing differs from what the ledger is charged for")
        group.load_weights(checkpoint.state, self._config.private_size)
        return group.support(*releases, gate, self._config.privacy.noise, self._config.private_size)

    def shutdown(self) -> None:
        if self._group is not None:
            self._group.shutdown()


@dataclass(frozen=True)
class ActiveLearningResult:
    """What a run of private active learning found: each DP checkpoint (epoch, ε, test accuracy),
    each strategy's row per label budget (accuracy, ε, the share of out-of-domain picks), the
    privacy report, and the public pool's counts (public numbers)."""

    checkpoints: list[dict[str, Any]]
    rows: list[dict[str, Any]]
    privacy: RunPrivacy
    public_pool: int
    out_of_domain: int
    labels_bought: int
    nodes: dict[str, list[str]]  # owner → the Ray nodes its shard actors ran on


def learn_actively(config: ActiveLearningConfig, results: RunDirectory,
                   ray_address: str | None = None) -> ActiveLearningResult:
    """DP-SGD checkpoints on the private shards, then every strategy's labels bought and
    fine-tuned on (steps 1–4 of the module's docstring). Checkpoints are kept under
    ``results.path``; the ledger, durable, under ``results.durable``."""
    from conclave.cluster.gateway.local import LocalGateways

    if not config.owners or config.through_gateways:
        return _learn_actively(config, results, ray_address)
    # Owners named by their data: their gateways on this machine, started here. Their DP-SGD steps and
    # NearPrivate's releases run in the gateways' own threads; no Ray is needed for them.
    with LocalGateways.start(config.owners, cpus_per_actor=1.0) as local:
        return _learn_actively(local.reach(config), results, ray_address, local.budget_sources)


def _learn_actively(config: ActiveLearningConfig, results: RunDirectory, ray_address: str | None,
                    budget_sources: dict[str, str] | None = None) -> ActiveLearningResult:
    """``learn_actively`` with owners named by their gateways, if any (``budget_sources``: where each owner's
    budget comes from, for gateways the run started on this machine)."""
    import torch

    from conclave.cluster.active_gateways import GatewayOwners, declared_records
    from conclave.cluster.ray_runtime import start_ray
    from conclave.learning.training import evaluate

    if not config.owners:  # behind gateways the owners' work runs on their own Rays: nothing here needs one
        start_ray(ray_address, runtime_env=config.runtime_env, models=config.models)
    torch.set_num_threads(config.torch_threads)
    out = Path(results.path)
    rng = np.random.default_rng(config.seed)
    sel = config.selection

    # 1. Public pool (labels hidden behind the annotator) and test set; the private part is
    #    read only by the actors that hold it.
    public = public_side(config, rng)
    pool_inputs, annotator, out_of_domain, test = public.pool_inputs, public.annotator, public.out_of_domain, public.test
    client = None
    if config.annotator.kind == "aggregator":
        from conclave.cluster.client import AggregatorClient

        token = os.environ.get(config.annotator.token_env) if config.annotator.token_env else None
        client = AggregatorClient(config.annotator.address, token=token, root_cert=config.annotator.root_cert)
        annotator = aggregator_annotator(public.pool_images, client, config.annotator.batch)  # teachers see images
    if config.buys_labels and max(sel.sizes) > len(pool_inputs):
        raise InvalidValue(f"selection.sizes go up to {max(sel.sizes)} but the public pool has {len(pool_inputs)} points")
    spec = public.model_spec(config)
    records = declared_records(config.owners, config.gateways) if config.through_gateways else config.private_size
    shards = (GatewayOwners(config, spec, public.classes, public.reading, records, budget_sources)
              if config.through_gateways else PrivateShards(config, spec))

    # 2. DP checkpoints. The ledger's budget is fixed from the planned work before anything
    #    private is read, and the whole schedule is charged before training starts.
    reused = _reused_checkpoints(config)
    planned = planned_work(config, records)
    durable = config.privacy.open_ledger(results.durable / "ledger.sqlite", planned, durable=True)
    ledger = durable  # each owner's ledger is charged by its gateway, each step before its share leaves
    # Earlier runs in this folder charged the same private data: the published guarantee covers
    # them too. Every charge this pipeline makes is fixed work (a DP-SGD schedule, DP-PCA,
    # counts), so what the ledger holds is their data-independent worst case.
    covered = planned
    if ledger.report().charges:
        log.warning("%s already holds %d charges from earlier runs on the same private data; the guarantee "
                    "covers them with this run's", ledger.path, ledger.report().charges)
        covered = sum_charges([ledger.spent(), planned], label="earlier runs on this ledger + planned")
    try:
        if config.through_gateways:
            checkpoints, dp_info = shards.train(ledger)
            _save(checkpoints, out)
        else:
            checkpoints, dp_info = _dp_checkpoints(config, shards, ledger, out, reused)
        checkpoint_rows = [{"epoch": c.epoch, "epsilon_opacus": c.epsilon,
                            "epsilon": _epsilon([c.charge()], config.privacy.delta),
                            "test_accuracy": evaluate(c.load_into(spec.build()), test)}
                           for c in checkpoints]

        # 3. Strategies → labels → fine-tuning → test accuracy.
        rows, per_model, figures = improve(config, checkpoints, shards, spec, ledger, pool_inputs, annotator,
                                           out_of_domain, test, rng, out)
        privacy = config.privacy.report(covered, ledger, dp_sgd_trust(config.secure_training)).adding(
            per_model=per_model, dpsgd=dp_info, **figures)
        if config.through_gateways:  # each owner's lifetime account after NearPrivate's releases too
            privacy = privacy.with_owner_accounts(shards.accounts())
    finally:
        shards.shutdown()
        ledger.close()  # an owner's ledger is released for the next run even when this one failed
    for row in rows:
        row["start_accuracy"] = checkpoint_rows[row["start_epoch"] - 1]["test_accuracy"]
    if client is not None:
        privacy = privacy.adding(annotator_aggregator=client.budget())  # its own ledger: the teachers' data
        client.close()

    return ActiveLearningResult(checkpoint_rows, rows, privacy, len(pool_inputs), int(out_of_domain.sum()),
                                annotator.bought, shards.nodes)


@dataclass(frozen=True)
class BothLedgers(ChargeGate):
    """NearPrivate's releases go to the run's ledger and to the model's own (its guarantee): either
    may refuse, before anything is computed; the run's is charged first."""

    run: Ledger  # the run's view; each owner's lifetime ledger is charged at its gateway
    model: PrivacyLedger

    def can_afford(self, charge: PrivacyCharge) -> bool:
        return self.run.can_afford(charge) and self.model.can_afford(charge)

    def charge(self, charge: PrivacyCharge) -> None:
        self.run.charge(charge)
        self.model.charge(charge)


def _epsilon(charges: list, delta: float) -> float:
    """ε at ``delta`` of work fixed in advance whose charges are ``charges`` (its worst-case guarantee)."""
    return float(worst_case_guarantee(sum_charges(charges), delta).epsilon)


def _reused_checkpoints(config: ActiveLearningConfig) -> list:
    """The DP checkpoints of an earlier run (``checkpoints_from``: public DP outputs), or none."""
    if config.checkpoints_from is None:
        return []  # before the import: planning a fresh schedule needs neither torch nor Ray
    from conclave.actors.dp_trainer import DPCheckpoint

    files = sorted((Path(config.checkpoints_from) / "checkpoints").glob("epoch-*.pt"))
    if not files:
        raise InvalidValue(f"checkpoints_from: no checkpoints/epoch-*.pt under {config.checkpoints_from}")
    return [DPCheckpoint.load(f) for f in files]


def _dp_checkpoints(config: ActiveLearningConfig, shards: PrivateShards, ledger, out: Path,
                    reused: list) -> tuple[list, dict]:
    """Train (or reuse) the DP-SGD checkpoints, one per epoch. The whole schedule is charged
    to ``ledger`` first."""
    from conclave.learning.dp_schedule import dp_schedule

    dp = config.dpsgd
    if reused:
        ledger.charge(reused[-1].charge())
        final = reused[-1]
        return reused, {"sample_rate": final.sample_rate, "noise_multiplier": final.noise_multiplier,
                        "epochs": final.epoch, "reused_from": config.checkpoints_from}
    schedule = dp_schedule(config.private_size, dp.dp_config(config.privacy.delta), secure=config.secure_training)
    dp_config = dataclasses.replace(dp.dp_config(config.privacy.delta), noise_multiplier=schedule.noise_multiplier,
                                    target_epsilon=None)
    group = shards.group  # started (and every owner's data loaded) before anything is charged
    if group.secure != schedule.secure:
        raise RuntimeError("the shard actors' way of summing differs from what the ledger is charged for")
    ledger.charge(schedule.charge)
    log.info("DP-SGD: q=%.5f σ=%.3f %d epochs over %d shard actor(s)", schedule.sample_rate,
             schedule.noise_multiplier, dp.epochs, len(group.actors))
    checkpoints = group.train(dp_config, config.privacy.noise, config.private_size, progress=True)
    if checkpoints[-1].sample_rate != schedule.sample_rate or checkpoints[-1].steps != schedule.steps:
        raise RuntimeError("the trainer's sampling differs from what the ledger was charged for")
    _save(checkpoints, out)
    return checkpoints, {"sample_rate": schedule.sample_rate, "noise_multiplier": schedule.noise_multiplier,
                         "epochs": dp.epochs, "declared_private_size": config.private_size,
                         "shard_actors": len(group.actors)}


def _save(checkpoints: list, out: Path) -> None:
    (out / "checkpoints").mkdir(exist_ok=True)
    for checkpoint in checkpoints:
        checkpoint.save(out / "checkpoints" / f"epoch-{checkpoint.epoch:03d}.pt")


def _near_private_start(config: ActiveLearningConfig, checkpoints: list, extra: list):
    """NearPrivate's checkpoint: the configured epoch, else the latest whose ε_dp ⊕ ε_dpPCA ⊕
    ε_support does not exceed the final checkpoint's ε (the first one if none does)."""
    sel = config.selection
    if sel.near_private_epoch is not None:
        if not 1 <= sel.near_private_epoch <= len(checkpoints):
            raise InvalidValue(f"selection.near_private_epoch must be in [1, {len(checkpoints)}]")
        return checkpoints[sel.near_private_epoch - 1]
    target = _epsilon([checkpoints[-1].charge()], config.privacy.delta)
    matching = [c for c in checkpoints if _epsilon([c.charge(), *extra], config.privacy.delta) <= target + 1e-9]
    return matching[-1] if matching else checkpoints[0]


def improve(config: ActiveLearningConfig, checkpoints: list, shards: PrivateShards | GatewayOwners, spec, ledger,
            pool_inputs: np.ndarray, annotator,
            out_of_domain: np.ndarray, test, rng: np.random.Generator,
            out: Path) -> tuple[list[dict], dict[str, Guarantee], dict[str, Any]]:
    """Every strategy from its starting checkpoint; one report-only ledger per published model.
    Returns the rows, each model's own guarantee, and NearPrivate's public figures (if it ran)."""
    from tqdm.auto import tqdm

    from conclave.learning.data import Dataset
    from conclave.learning.selection import PublicPool, build_strategy
    from conclave.learning.training import embed, evaluate, fit, predict_logits
    from conclave.progress import COUNTS

    sel, delta = config.selection, config.privacy.delta
    if not config.buys_labels:  # the DP model is the result
        return [], {}, {}
    releases = config.selection_releases()  # the planned ones: what the budget was fixed from
    near_start = _near_private_start(config, checkpoints, [r.charge() for r in releases]) if releases else None
    noise = config.privacy.noise
    finetune = config.finetune.train_config(config.seed)
    model_ledgers: dict[str, PrivacyLedger] = {}
    pools: dict[int, PublicPool] = {}
    rows: list[dict] = []
    progress = tqdm(total=len(sel.strategies) * len(sel.sizes), desc="active learning", unit="models",
                    bar_format=COUNTS)
    for name in sel.strategies:
        start = near_start if name == "near_private" else checkpoints[-1]
        # What this one model costs on its own: an in-memory view (the run's ledger is the durable one).
        model_ledger = model_ledgers[name] = PrivacyLedger(":memory:", delta)
        model_ledger.charge(start.charge())
        if start.epoch not in pools:
            model = start.load_into(spec.build())
            pools[start.epoch] = PublicPool(predict_logits(model, pool_inputs), embed(model, pool_inputs))
        params: dict = {}
        if name == "diverse_public":
            params = {"components": sel.components, "n_each": sel.n_each, "uncertain_factor": sel.uncertain_factor}
        elif name == "near_private":
            support = shards.support(start, releases, BothLedgers(ledger, model_ledger))
            params = {"support": support, "components": sel.components, "uncertain_factor": sel.uncertain_factor}
        selections = build_strategy(name, **params).select(pools[start.epoch], sel.sizes, rng)
        epsilon = _epsilon([model_ledger.spent()], delta)  # fixed work: its worst case is its guarantee
        for size in sorted(selections):
            chosen = selections[size]
            labels = annotator.label(chosen)
            keep = labels >= 0  # an aggregator-backed annotator may abstain
            others = np.setdiff1d(np.arange(len(pool_inputs)), chosen)
            replay = np.random.default_rng([config.seed, size]).permutation(others)[: config.finetune.replay]
            pseudo = pools[start.epoch].logits[replay].argmax(axis=1).astype(np.int64)
            bought = Dataset(np.concatenate([pool_inputs[chosen[keep]], pool_inputs[replay]]),
                             np.concatenate([labels[keep], pseudo]), spec.num_classes, f"bought-{name}", test.features)
            model = start.load_into(spec.build())
            fit(model, bought, finetune)
            rows.append({"strategy": name, "n_labeled": int(size), "accuracy": evaluate(model, test),
                         "epsilon": epsilon, "start_epoch": start.epoch,
                         "out_of_domain_share": float(np.mean(out_of_domain[chosen]))})
            progress.update(1)
    progress.close()
    unsound = (noise.unsound_reason,) if noise.unsound_reason else ()
    per_model = {name: worst_case_guarantee(l.spent(), delta).marked(unsound) for name, l in model_ledgers.items()}
    figures: dict[str, Any] = {}  # NearPrivate's public figures
    for l in model_ledgers.values():
        l.close()
    if releases:
        pca, counts = releases
        near_total = _epsilon([near_start.charge(), pca.charge(), counts.charge()], delta)
        figures["near_private"] = {"start_epoch": near_start.epoch, "epsilon_dp": _epsilon([near_start.charge()], delta),
                         "epsilon_pca": sel.epsilon_pca, "epsilon_support": sel.epsilon_support,
                         "pca": pca.summary(), "support": counts.summary(),
                         "epsilon_total": near_total,  # composed in RDP (what the ledger says)
                         "epsilon_additive": _epsilon([near_start.charge()], delta) + sel.epsilon_pca
                         + sel.epsilon_support,  # the paper's bookkeeping: a looser upper bound
                         "matches_final_checkpoint": near_total <= _epsilon([checkpoints[-1].charge()], delta) + 1e-9}
    return rows, per_model, figures
