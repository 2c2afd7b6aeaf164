"""Sparse DP fine-tuning (Luo et al. 2021): public pre-training → mask → DP fine-tuning → test.

1. Pre-train the network on the public data without privacy, saving a checkpoint every
   ``pretrain.checkpoint_every`` epochs under ``results/<run>/checkpoints/``; a rerun of the
   same run resumes from the latest one.
2. For each configured variant, charge the run's ledger with its DP-SGD schedule and fine-tune
   on the private data. A benchmark's private split is held by one shard actor, sent the public
   weights: it replaces the classifier, builds the plan (the magnitude mask comes from the
   public weights only) and DP-fine-tunes (``actors.sparse_trainer.SparseVariant``). With
   ``owners``, every owner's gateway is sent the public weights and the variant's public mask and
   admits the variant by its owner's policy; each step is a secure sum of the gateways' shares,
   charged in each owner's ledger first (``cluster.sparse_gateways``). The gateways are the
   owners' own (``owners: [{name, gateway}]`` with ``gateways:``) or, for owners named by their
   data, ones the run starts on this machine (``cluster.gateway.local``): the same code either way.
3. Evaluate each released DP model on the private task's test split (public: the benchmark's
   test split, or the config's ``test`` source).
4. Report the guarantee: every variant trains on the same private data, so the planned work
   is all of their DP-SGD schedules (fixed before the data is read), and the ledger's budget,
   if declared, is a Rényi filter over them; each variant's own ε is reported beside it.

``finetune_sparsely`` returns a typed ``SparseResult``; ``conclave run`` reaches it through
``cluster.pipelines.sparse_finetune``, which writes the results folder. ``SparseConfig()`` is a
seconds-scale demo on the bundled digits (0–4 public, 5–9 private).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conclave.cluster.config import as_base
from conclave.cluster.owners import DataOwner, GatewaysConfig, check_behind_gateways, check_gateways, check_owners
from conclave.cluster.results import RunDirectory
from conclave.cluster.run_privacy import PrivacyConfig, RunPrivacy, dp_sgd_trust
from conclave.errors import InvalidValue
from conclave.learning.data.sources import DataSource, PublicReading
from conclave.learning.dp_schedule import DPSGDConfig
from conclave.learning.sparse_variants import VARIANTS
from conclave.learning.train_config import TrainConfig

if TYPE_CHECKING:
    from conclave.actors.dp_trainer import DPCheckpoint
    from conclave.actors.sparse_trainer import PublicModel, SparseVariant
    from conclave.cluster.run_privacy import GatewayAccount
    from conclave.cluster.sparse_gateways import GatewayVariants
    from conclave.learning.data import Dataset
    from conclave.learning.dp_schedule import DPSchedule
    from conclave.privacy.accounting.ledger import Ledger

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelConfig:
    name: str = "gn_cnn"  # a learning.models name or module:function with a .classifier (docs/data-and-models.md)
    in_channels: int = 1
    kwargs: dict = field(default_factory=lambda: {"channels": 8})


@dataclass(frozen=True)
class DataSpec:
    """A training split restricted to ``classes`` (relabelled 0..k-1; all when empty),
    optionally a seeded subsample of ``size``; the test split gets the same classes. For the
    private split ``size`` is also the declared N of the DP-SGD schedule (``SparseConfig.private_size``)."""

    dataset: str = "digits"
    root: str | None = None
    classes: tuple[int, ...] = ()
    size: int | None = None

    def __post_init__(self) -> None:
        if self.size is not None and self.size < 1:
            raise InvalidValue(f"size must be >= 1 or null, got {self.size}")
        if len(set(self.classes)) != len(self.classes):
            raise InvalidValue(f"classes must be distinct, got {list(self.classes)}")


@dataclass(frozen=True)
class PretrainConfig(TrainConfig):
    """Public pre-training: learning's ``TrainConfig`` with this section's defaults, plus
    ``checkpoint_every``; its seed is the run's (``pretrain_public`` derives one per epoch)."""

    epochs: int = 8
    lr: float = 3e-3
    seed: int = field(default=0, init=False)  # not a key: the run's seed
    checkpoint_every: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.epochs < 1 or self.checkpoint_every < 1:
            raise InvalidValue("pretrain.epochs and pretrain.checkpoint_every must be >= 1")


@dataclass(frozen=True)
class DPFinetuneConfig(DPSGDConfig):
    """DP-SGD on the private set: learning's ``DPSGDConfig`` with this section's defaults (give
    ``target_epsilon``, per variant, or ``noise_multiplier``), plus the variants to train and the
    new classifier's own learning rate. δ is the run's ``privacy.delta``, not a key here."""

    variants: tuple[str, ...] = ("classifier", "classifier+norm", "all")
    fraction: float = 0.01  # p: share of convolution weights the "all" variant trains
    epochs: int = 5
    batch_size: int = 128  # expected (Poisson) batch size
    lr: float = 0.05  # normalisation and convolution parameters
    classifier_lr: float | None = 0.5  # the new classifier (the paper: 0.8 vs 0.01)
    momentum: float = 0.9
    target_epsilon: float | None = 1.0
    # A placeholder that passes DPSGDConfig's checks: train and price with ``dp_config(delta)``.
    delta: float = field(default=1e-5, init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [v for v in self.variants if v not in VARIANTS]
        if not self.variants or unknown:
            raise InvalidValue(f"finetune.variants must be a non-empty list of {list(VARIANTS)}, got {list(self.variants)}")
        if not 0 < self.fraction <= 1:
            raise InvalidValue(f"finetune.fraction must be in (0, 1], got {self.fraction}")
        if self.classifier_lr is not None and self.classifier_lr <= 0:
            raise InvalidValue(f"finetune.classifier_lr must be > 0 or null, got {self.classifier_lr}")
        if self.classifier_lr is not None and any(p.startswith("classifier.") for p, _ in self.lr_overrides):
            raise InvalidValue("finetune: classifier_lr sets the classifier's rate; to set it in lr_overrides, "
                             "set classifier_lr: null")
        if "all" in self.variants and self.grad_sample_mode in ("ghost", "bk"):
            raise InvalidValue("finetune: the all variant's masks act on per-example gradients: "
                             "set grad_sample_mode: hooks or auto")

    def dp_config(self, delta: float) -> DPSGDConfig:
        """The DP-SGD run of every variant, at the run's δ: ``classifier_lr`` goes first in
        ``lr_overrides`` (first match wins)."""
        classifier = (("classifier.", self.classifier_lr),) if self.classifier_lr is not None else ()
        return as_base(self, DPSGDConfig, delta=delta, lr_overrides=classifier + self.lr_overrides)


DEFAULT_PRIVATE = DataSpec("digits", classes=(5, 6, 7, 8, 9))


@dataclass(frozen=True)
class SparseConfig:
    name: str = "sparse-demo"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    public: DataSpec = field(default_factory=lambda: DataSpec("digits", classes=(0, 1, 2, 3, 4)))
    private: DataSpec = field(default_factory=lambda: DEFAULT_PRIVATE)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    finetune: DPFinetuneConfig = field(default_factory=DPFinetuneConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    # Owners' own data (instead of ``private``): each owner's images, read only behind its gateway;
    # every owner named by its data declares its ``records``. ``test``: the private task's labelled
    # public test set, ``classes`` its label names (None: the test data's).
    owners: tuple[DataOwner, ...] = ()
    test: DataSource | None = None
    classes: tuple[str, ...] | None = None
    # Ray's runtime_env for the run's workers; a model of your own is added to its py_modules by the run.
    runtime_env: dict = field(default_factory=dict)
    # The coordinator's certificates for owners named by their gateway (``owners: [{name, gateway}]``):
    # each variant's DP-SGD then runs as steps at the owners' gateways (``cluster.sparse_gateways``).
    gateways: GatewaysConfig | None = None

    def __post_init__(self) -> None:
        check_gateways(self.owners, self.gateways)
        if not self.owners:
            if self.test is not None or self.classes is not None:
                raise InvalidValue("test and classes go with owners (or use the private section alone)")
            return
        check_owners(self.owners, self.test, self.classes, None, needs_public=False)
        check_behind_gateways(self.owners)
        self._check_gateways()
        if self.private != DEFAULT_PRIVATE:
            raise InvalidValue("with owners, leave the private section out (the owners' sources are the private data)")

    def _check_gateways(self) -> None:
        """Fine-tuning at the owners' gateways (their own, or those the run starts on this machine): a
        registered model by name with numbers for its own arguments (a gateway runs no code a config
        names), and noise from OS entropy."""
        from conclave.learning.models.registry import REGISTRY

        if self.model.name not in REGISTRY:
            raise InvalidValue(f"model.name {self.model.name!r}: sparse fine-tuning behind gateways trains a registered "
                             "model (a gateway runs no code a config names)")
        for key, value in self.model.kwargs.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidValue(f"model.kwargs.{key}: a gateway builds its model with numbers only, got {value!r}")
        if self.privacy.insecure_noise_seed is not None:
            raise InvalidValue("privacy.insecure_noise_seed: the gateways draw noise from OS entropy only; remove it")

    @property
    def through_gateways(self) -> bool:
        """Whether the owners are named by their gateways (never their files); owners named by their
        data fine-tune behind gateways the run starts on this machine (``cluster.gateway.local``)."""
        return self.gateways is not None

    @property
    def models(self) -> tuple[str, ...]:
        """The model this run builds."""
        return (self.model.name,)

    @property
    def private_size(self) -> int:
        """The private examples DP-SGD's schedule is computed from. Owners declare theirs; a
        benchmark split's is its ``private.size`` when set (an upper bound, like an owner's
        records: a smaller split only makes the Poisson batches smaller), else counted from
        its files (a split of public files: treated as public). Owners behind gateways declare
        theirs there (``active_gateways.declared_records``)."""
        if self.through_gateways:
            raise InvalidValue("owners named by their gateway declare their records there, not in the config")
        if self.owners:
            return sum(owner.records for owner in self.owners)
        if self.private.size is not None:
            return self.private.size
        return len(load_split(self.private, self.seed)[0])

    @property
    def secure_training(self) -> bool:
        """Whether DP-SGD sums across the owners' gateways, through the secure sum (a benchmark's split is
        held by one actor)."""
        return bool(self.owners)


# --- phases -----------------------------------------------------------------------------


def load_split(spec: DataSpec, seed: int):
    """(train, test) of ``spec`` (see ``learning.sparse.transfer_split``)."""
    from conclave.learning.sparse import transfer_split

    return transfer_split(spec.dataset, spec.root, spec.classes, spec.size, seed)


def pretrain_public(model, data, config: PretrainConfig, seed: int, checkpoint_dir: Path | None,
                    progress: bool = True) -> list[float]:
    """Non-private training on public data, one epoch at a time with checkpoints; resumes
    from the latest checkpoint in ``checkpoint_dir``. Returns the loss of every epoch."""
    import torch
    from tqdm import tqdm

    from conclave.learning.training import fit

    losses: list[float] = []
    start = 0
    if checkpoint_dir is not None:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        saved = sorted(checkpoint_dir.glob("public-epoch-*.pt"))
        saved = [p for p in saved if int(p.stem.rsplit("-", 1)[1]) <= config.epochs]
        if saved:
            checkpoint = torch.load(saved[-1], weights_only=False)
            model.load_state_dict(checkpoint["state"])
            start, losses = checkpoint["epoch"], list(checkpoint["losses"])
            log.info("resumed public pre-training from %s", saved[-1])
    for epoch in tqdm(range(start, config.epochs), desc="public pre-training", disable=not progress,
                      initial=start, total=config.epochs):
        one_epoch = as_base(config, TrainConfig, epochs=1, seed=seed * 10_007 + epoch)
        losses += fit(model, data, one_epoch)
        last = epoch + 1 == config.epochs
        if checkpoint_dir is not None and ((epoch + 1) % config.checkpoint_every == 0 or last):
            torch.save({"epoch": epoch + 1, "losses": losses, "state": model.state_dict()},
                       checkpoint_dir / f"public-epoch-{epoch + 1:04d}.pt")
    return losses


def planned_work(config: SparseConfig, records: int | None = None):
    """Every variant's DP-SGD schedule, on ``records`` examples (what the owners' gateways declare;
    None: ``config.private_size``, declared by the owners or the size of a split of a public
    benchmark's files)."""
    from conclave.learning.dp_schedule import dp_schedule
    from conclave.privacy.accounting.rdp import sum_charges

    dp_config = config.finetune.dp_config(config.privacy.delta)
    size = config.private_size if records is None else records
    return sum_charges([dp_schedule(size, dp_config, label=f"dpsgd-sparse-{v}", secure=config.secure_training).charge
                        for v in config.finetune.variants], label="planned")


def private_test(config: SparseConfig):
    """The private task's test split and class names: the ``test`` source with owners, else
    the benchmark's (public data, read by the driver)."""
    if config.owners:
        from conclave.learning.data.sources import class_names

        classes = config.classes or class_names(config.test.read_raw().labels)
        return config.test.read(classes, "test"), classes
    _, test = load_split(config.private, config.seed)
    return test, tuple(str(c) for c in range(test.num_classes))


def validate(config: SparseConfig) -> SparseConfig:
    """Before Ray starts: with owners, the test source is read (and its classes found); the
    model is checked against the model contract on the public split's inputs, with the
    ``.classifier`` the variants replace and layers DP-SGD can train."""
    from conclave.cluster.config import ConfigError
    from conclave.learning.models import check_model

    if config.owners:
        try:
            private_test(config)
        except (ValueError, OSError) as err:
            raise ConfigError(f"test: {err}") from err
    try:
        public_train, _ = load_split(config.public, config.seed)
    except (ValueError, OSError) as err:
        raise ConfigError(f"public: {err}") from err
    try:
        check_model(config.model.name, public_train.num_classes, public_train.input_shape, dp_sgd=True,
                    parts={"classifier": "sparse fine-tuning replaces for the private task"},
                    **config.model.kwargs)
    except ValueError as err:
        raise ConfigError(f"model.name: {err}") from None
    return config


@dataclass(frozen=True)
class SparseResult:
    """What a sparse fine-tuning run found: the public model (its pre-training losses and public
    test accuracy), each variant's accuracy on the private task's test split with its ε, schedule
    and trained fraction, and the privacy report composing every variant."""

    public_losses: list[float]
    public_accuracy: float
    public_dataset: str
    private_test: str
    variants: dict[str, dict[str, Any]]
    privacy: RunPrivacy
    nodes: dict[str, list[str]]  # the benchmark's split → the Ray node its shard actor ran on (owners: none)


@dataclass(frozen=True)
class PublicPretraining:
    """The public model every variant fine-tunes, with its pre-training losses and its accuracy
    on the public test split: public data only, free. A sweep pre-trains once
    (``SparseFinetune.pretrain``) and hands it to every trial."""

    model: PublicModel
    losses: list[float]
    accuracy: float
    dataset: str  # the public test split's name


def pretrain(config: SparseConfig, checkpoint_dir: Path | None) -> PublicPretraining:
    """Step 1 of the module's docstring: pre-train on the public split, resuming from ``checkpoint_dir``."""
    from conclave.actors.sparse_trainer import PublicModel
    from conclave.learning.models import build_model
    from conclave.learning.training import evaluate

    public_train, public_test = load_split(config.public, config.seed)
    model = build_model(config.model.name, public_train.num_classes, config.model.in_channels,
                        seed=config.seed, input_shape=public_train.input_shape, **config.model.kwargs)
    losses = pretrain_public(model, public_train, config.pretrain, config.seed, checkpoint_dir)
    accuracy = evaluate(model, public_test)
    log.info("public model: %.4f on %s", accuracy, public_test.name)
    state = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    public = PublicModel(config.model.name, public_train.num_classes, config.model.in_channels,
                         dict(config.model.kwargs), state, public_train.input_shape)
    return PublicPretraining(public, losses, accuracy, public_test.name)


def finetune_sparsely(config: SparseConfig, results: RunDirectory, ray_address: str | None = None,
                      public: PublicPretraining | None = None, every_epoch: bool = False) -> SparseResult:
    """Steps 1–4 of the module's docstring; pre-training checkpoints go under ``results.path``.
    ``public``: the public model already pre-trained (step 1 skipped). ``every_epoch``: also
    evaluate each variant's model after every epoch (``variants[v]["accuracies"]``; the test
    split is public, so this is free)."""
    from conclave.cluster.gateway.local import LocalGateways

    if not config.owners or config.through_gateways:
        return _finetune_sparsely(config, results, ray_address, public, every_epoch)
    # Owners named by their data: their gateways on this machine, started here. Their DP-SGD steps run in
    # the gateways' own threads; no Ray is needed for them.
    with LocalGateways.start(config.owners, cpus_per_actor=1.0) as local:
        return _finetune_sparsely(local.reach(config), results, ray_address, public, every_epoch,
                                  local.budget_sources)


def _finetune_sparsely(config: SparseConfig, results: RunDirectory, ray_address: str | None,
                       public: PublicPretraining | None, every_epoch: bool,
                       budget_sources: dict[str, str] | None = None) -> SparseResult:
    """``finetune_sparsely`` with owners named by their gateways, if any (``budget_sources``: where each
    owner's budget comes from, for gateways the run started on this machine)."""
    from conclave.actors.sparse_trainer import SparseVariant
    from conclave.cluster.active_gateways import declared_records
    from conclave.cluster.ray_runtime import start_ray
    from conclave.learning.dp_schedule import dp_schedule
    from conclave.learning.training import evaluate

    if not config.owners:  # behind gateways the owners' work runs on their own Rays: nothing here needs one
        start_ray(ray_address, runtime_env=config.runtime_env, models=config.models)
    if public is None:
        public = pretrain(config, results.path / "checkpoints")

    ledger_path = results.path / "ledger.sqlite"
    for stale in ledger_path.parent.glob(ledger_path.name + "*"):
        stale.unlink()  # a run accounts for its own fine-tunings
    test, classes = private_test(config)
    dp_config = config.finetune.dp_config(config.privacy.delta)
    records = declared_records(config.owners, config.gateways) if config.owners else config.private_size
    planned = planned_work(config, records)
    variants: dict[str, dict[str, Any]] = {}
    with config.privacy.open_ledger(ledger_path, planned) as ledger, \
            _private_side(config, test, classes, budget_sources) as private:
        for variant in config.finetune.variants:
            recipe = SparseVariant(public.model, variant, config.finetune.fraction, len(classes), config.seed)
            schedule = dp_schedule(records, dp_config, label=f"dpsgd-sparse-{variant}", secure=config.secure_training)
            # the run's ledger is charged the schedule before anything private is computed; over budget: refused
            checkpoints = private.train(dp_config, schedule, recipe, ledger)
            accuracy = evaluate(recipe.released(checkpoints[-1].state), test)
            _, plan = recipe.planned()
            log.info("variant %s: accuracy %.4f at ε %.3f", variant, accuracy, checkpoints[-1].epsilon)
            variants[variant] = {
                "accuracy": accuracy, "epsilon": checkpoints[-1].epsilon,
                "epsilons": [c.epsilon for c in checkpoints], "noise_multiplier": schedule.noise_multiplier,
                "sample_rate": schedule.sample_rate, "steps": checkpoints[-1].steps,
                "trained_entries": plan.trained_entries, "trained_fraction": plan.trained_entries / plan.total_entries,
            }
            if every_epoch:
                variants[variant]["accuracies"] = [evaluate(recipe.released(c.state), test) for c in checkpoints]
        privacy = config.privacy.report(planned, ledger, dp_sgd_trust(config.secure_training)).adding(
            per_variant_epsilon={v: r["epsilon"] for v, r in variants.items()},
            note="every variant fine-tuned on the same private data; the run's guarantee composes them all",
        ).with_owner_accounts(private.accounts())  # each owner's lifetime account after the last step
        nodes = private.nodes
    return SparseResult(public.losses, public.accuracy, public.dataset, test.name, variants, privacy, nodes)


class BenchmarkSplit:
    """A benchmark's private split on one shard actor (with a GPU when the cluster has one), as the private
    side of a run's fine-tunings (``cluster.sparse_gateways.GatewayVariants`` is the owners')."""

    def __init__(self, config: SparseConfig, input_shape: tuple[int, ...]) -> None:
        from conclave.actors.dp_trainer import ShardGroup, ShardPlan
        from conclave.actors.sparse_trainer import TransferSource
        from conclave.cluster.ray_runtime import gpus_available

        private = config.private
        source = TransferSource(private.dataset, private.root, private.classes, private.size, config.seed)
        self._noise = config.privacy.noise
        self._group = ShardGroup([ShardPlan(source, (0,))], num_cpus=1.0, num_gpus=min(1.0, gpus_available()),
                                 input_shape=input_shape)

    def train(self, dp_config: DPSGDConfig, schedule: DPSchedule, recipe: SparseVariant,
              ledger: Ledger) -> list[DPCheckpoint]:
        """``recipe`` DP-fine-tuned on the split with ``schedule``'s sampling, charged to ``ledger`` first."""
        ledger.charge(schedule.charge)
        return self._group.train(dp_config, self._noise, schedule.num_examples, recipe, progress=True)

    @property
    def nodes(self) -> dict[str, list[str]]:
        """The split's owner → the Ray node its shard actor ran on."""
        return self._group.placement

    def accounts(self) -> dict[str, GatewayAccount]:
        """No owner keeps a ledger of a benchmark's split."""
        return {}

    def __enter__(self) -> BenchmarkSplit:
        return self

    def __exit__(self, *exc: object) -> None:
        self._group.shutdown()


def _private_side(config: SparseConfig, test: Dataset, classes: tuple[str, ...],
                  budget_sources: dict[str, str] | None) -> GatewayVariants | BenchmarkSplit:
    """Who fine-tunes on the private data: the owners' gateways (their images read at the test images'
    size), or the shard actor holding a benchmark's split."""
    from conclave.cluster.sparse_gateways import GatewayVariants

    if config.owners:
        size = (test.input_shape[-2], test.input_shape[-1]) if test.is_image else None
        return GatewayVariants(config, classes, PublicReading(size=size), budget_sources)
    return BenchmarkSplit(config, test.input_shape)
