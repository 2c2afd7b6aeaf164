"""Sparse DP fine-tuning (Luo et al. 2021): public pre-training → mask → DP fine-tuning → test.

1. Pre-train the network on the public data without privacy, saving a checkpoint every
   ``pretrain.checkpoint_every`` epochs under ``results/<run>/checkpoints/``; a rerun of the
   same run resumes from the latest one.
2. Send the public weights to a ``SparseTrainerActor`` that holds the private transfer set.
   For each configured variant it replaces the classifier, builds the plan (the magnitude
   mask comes from the public weights only), charges the run's ledger, and DP-fine-tunes.
3. Evaluate each released DP model on the private task's test split (not private data).
4. Report the guarantee: every variant trains on the same private data, so the planned work
   is all of their DP-SGD schedules (fixed before the data is read), and the ledger's budget,
   if declared, is a Rényi filter over them; each variant's own ε is reported beside it.

``Config()`` is a seconds-scale demo on the bundled digits (0–4 public, 5–9 private).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.pipelines import PrivacyConfig, RunOutcome
from learning.sparse import VARIANTS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelConfig:
    name: str = "gn_cnn"  # a learning.models registry name with .features/.classifier
    in_channels: int = 1
    kwargs: dict = field(default_factory=lambda: {"channels": 8})


@dataclass(frozen=True)
class DataSpec:
    """A training split restricted to ``classes`` (relabelled 0..k-1; all when empty),
    optionally a seeded subsample of ``size``; the test split gets the same classes."""

    dataset: str = "digits"
    root: str | None = None
    classes: tuple[int, ...] = ()
    size: int | None = None

    def __post_init__(self) -> None:
        if self.size is not None and self.size < 1:
            raise ValueError(f"size must be >= 1 or null, got {self.size}")
        if len(set(self.classes)) != len(self.classes):
            raise ValueError(f"classes must be distinct, got {list(self.classes)}")


@dataclass(frozen=True)
class PretrainConfig:
    epochs: int = 8
    batch_size: int = 64
    lr: float = 3e-3
    optimizer: str = "adam"  # adam | sgd
    momentum: float = 0.0
    weight_decay: float = 0.0
    checkpoint_every: int = 1

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.checkpoint_every < 1:
            raise ValueError("pretrain.epochs and pretrain.checkpoint_every must be >= 1")


@dataclass(frozen=True)
class FinetuneConfig:
    """DP-SGD on the private set. Give ``target_epsilon`` (per variant) or ``noise_multiplier``."""

    variants: tuple[str, ...] = ("classifier", "classifier+norm", "all")
    fraction: float = 0.01  # p: share of convolution weights the "all" variant trains
    epochs: int = 5
    batch_size: int = 128  # expected (Poisson) batch size
    lr: float = 0.05  # normalisation and convolution parameters
    classifier_lr: float | None = 0.5  # the new classifier (the paper: 0.8 vs 0.01)
    momentum: float = 0.9
    max_grad_norm: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = 1.0
    max_physical_batch_size: int | None = None

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if not self.variants or unknown:
            raise ValueError(f"finetune.variants must be a non-empty list of {list(VARIANTS)}, got {list(self.variants)}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"finetune.fraction must be in (0, 1], got {self.fraction}")
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("finetune: give exactly one of noise_multiplier and target_epsilon")
        self.dp_config(1e-5)  # any other bad value is a config error now, not on the actor

    def dp_config(self, delta: float):
        from learning.dpsgd import DPSGDConfig

        overrides = (("classifier.", self.classifier_lr),) if self.classifier_lr is not None else ()
        return DPSGDConfig(
            epochs=self.epochs, batch_size=self.batch_size, lr=self.lr, max_grad_norm=self.max_grad_norm,
            delta=delta, noise_multiplier=self.noise_multiplier, target_epsilon=self.target_epsilon,
            momentum=self.momentum, lr_overrides=overrides, max_physical_batch_size=self.max_physical_batch_size,
        )


@dataclass(frozen=True)
class Config:
    name: str = "sparse-demo"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    public: DataSpec = field(default_factory=lambda: DataSpec("digits", classes=(0, 1, 2, 3, 4)))
    private: DataSpec = field(default_factory=lambda: DataSpec("digits", classes=(5, 6, 7, 8, 9)))
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)


# --- phases -----------------------------------------------------------------------------


def load_split(spec: DataSpec, seed: int):
    """(train, test) of ``spec`` (see ``learning.sparse.transfer_split``)."""
    from learning.sparse import transfer_split

    return transfer_split(spec.dataset, spec.root, spec.classes, spec.size, seed)


def pretrain_public(model, data, config: PretrainConfig, seed: int, checkpoint_dir: Path | None,
                    progress: bool = True) -> list[float]:
    """Non-private training on public data, one epoch at a time with checkpoints; resumes
    from the latest checkpoint in ``checkpoint_dir``. Returns the loss of every epoch."""
    import torch
    from tqdm import tqdm

    from learning.training import TrainConfig, fit

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
        one_epoch = TrainConfig(epochs=1, batch_size=config.batch_size, lr=config.lr, seed=seed * 10_007 + epoch,
                                optimizer=config.optimizer, momentum=config.momentum,
                                weight_decay=config.weight_decay)
        losses += fit(model, data, one_epoch)
        last = epoch + 1 == config.epochs
        if checkpoint_dir is not None and ((epoch + 1) % config.checkpoint_every == 0 or last):
            torch.save({"epoch": epoch + 1, "losses": losses, "state": model.state_dict()},
                       checkpoint_dir / f"public-epoch-{epoch + 1:04d}.pt")
    return losses


def planned_work(config: Config):
    """Every variant's DP-SGD schedule. The number of private examples sets the Poisson rate and
    is treated as public, as in every DP-SGD accountant: here the size of a split of a public
    benchmark dataset, counted from the files (the examples themselves are dropped at once)."""
    from learning.dpsgd import dp_schedule
    from privacy.accounting.rdp import sum_charges

    size = len(load_split(config.private, config.seed)[0])
    dp_config = config.finetune.dp_config(config.privacy.delta)
    return sum_charges([dp_schedule(size, dp_config, label=f"dpsgd-sparse-{v}").charge
                        for v in config.finetune.variants], label="planned")


def run(config: Config, context) -> RunOutcome:
    import ray

    from actors.sparse_trainer import PublicModel, SparseTrainerActor, TransferSource
    from cluster.ray_runtime import gpus_available, start_ray
    from learning.models import build_model
    from learning.training import evaluate
    from privacy.accounting.ledger import PrivacyLedger

    start_ray(context.ray_address)
    public_train, public_test = load_split(config.public, config.seed)
    model = build_model(config.model.name, public_train.num_classes, config.model.in_channels,
                        seed=config.seed, **config.model.kwargs)
    public_losses = pretrain_public(model, public_train, config.pretrain, config.seed,
                                    context.results.path / "checkpoints")
    public_accuracy = evaluate(model, public_test)
    log.info("public model: %.4f on %s", public_accuracy, public_test.name)
    state = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    public = PublicModel(config.model.name, public_train.num_classes, config.model.in_channels,
                         dict(config.model.kwargs), state)

    ledger_path = context.results.path / "ledger.sqlite"
    for stale in ledger_path.parent.glob(ledger_path.name + "*"):
        stale.unlink()  # a run accounts for its own fine-tunings
    source = TransferSource(config.private.dataset, config.private.root, config.private.classes,
                            config.private.size, config.seed)
    _, private_test = load_split(config.private, config.seed)
    dp_config = config.finetune.dp_config(config.privacy.delta)
    planned = planned_work(config)
    # The actor takes a GPU when the cluster has one (train_dp then trains on it).
    trainer = SparseTrainerActor.options(num_cpus=1, num_gpus=min(1.0, gpus_available())).remote(
        source, str(ledger_path), config.privacy.delta, config.privacy.budget_filter(planned), config.privacy.noise)

    variants: dict[str, dict[str, Any]] = {}
    for variant in config.finetune.variants:
        result = ray.get(trainer.finetune.remote(public, variant, config.finetune.fraction, dp_config,
                                                 classifier_seed=config.seed, progress=True))
        released = PublicModel(config.model.name, private_test.num_classes, config.model.in_channels,
                               dict(config.model.kwargs), result.state).build()
        accuracy = evaluate(released, private_test)
        log.info("variant %s: accuracy %.4f at ε %.3f", variant, accuracy, result.epsilons[-1])
        variants[variant] = {
            "accuracy": accuracy, "epsilon": result.epsilons[-1], "epsilons": result.epsilons,
            "noise_multiplier": result.noise_multiplier,
            "sample_rate": result.sample_rate, "steps": result.steps,
            "trained_entries": result.trained_entries, "trained_fraction": result.trained_entries / result.total_entries,
        }
    ray.get(trainer.close.remote())
    ray.kill(trainer)

    with PrivacyLedger(ledger_path, config.privacy.delta, config.privacy.budget_filter(planned)) as ledger:
        privacy = {
            **config.privacy.report(planned, ledger), "delta": config.privacy.delta,
            "per_variant_epsilon": {v: r["epsilon"] for v, r in variants.items()},
            "note": "every variant fine-tuned on the same private data; the run's guarantee composes them all",
        }
    metrics = {
        "public": {"losses": public_losses, "accuracy": public_accuracy, "dataset": public_test.name},
        "private_test": private_test.name, "variants": variants,
    }
    context.results.write_json("metrics", metrics)
    context.results.write_json("privacy", privacy)
    summary = {f"accuracy[{v}]": round(r["accuracy"], 4) for v, r in variants.items()}
    summary["public_accuracy"] = round(public_accuracy, 4)
    guarantee = privacy["guarantee"]
    summary["guarantee (all variants)"] = (f"ε = {guarantee['epsilon']:.4g} at δ = {guarantee['delta']:g} "
                                           f"({guarantee['basis']}){'' if privacy['sound'] else ', NOT SOUND'}")
    return RunOutcome(summary, metrics, privacy)
