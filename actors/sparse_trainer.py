"""The private side of sparse DP fine-tuning: a Ray actor that holds the private transfer set.

The actor reads its private data itself (``TransferSource.load``), so it never passes
through the driver. It receives the *public* pre-trained weights, builds the variant's plan
(the mask comes from those public weights only), charges the run's ledger with the DP-SGD
schedule's cost *before* training, then trains with ``learning.dpsgd.train_dp`` and returns
the DP model's weights — the only thing derived from private data that leaves (no losses). Noise and Poisson sampling
come from the run's ``NoisePolicy``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import ray
import torch

from learning.data import Dataset
from learning.dpsgd import DPSGDConfig, dp_schedule, train_dp
from learning.models import build_model
from learning.sparse import plan_variant, replace_classifier, transfer_split
from privacy.accounting.filter import RenyiFilter
from privacy.accounting.ledger import BudgetReport, PrivacyLedger
from privacy.noise import NoisePolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferSource:
    """The private set: ``dataset``'s training split restricted to ``classes`` (relabelled
    0..k-1; all classes when empty), optionally a seeded subsample of ``size`` examples."""

    dataset: str
    root: str | None = None
    classes: tuple[int, ...] = ()
    size: int | None = None
    seed: int = 0

    def load(self) -> Dataset:
        train, _ = transfer_split(self.dataset, self.root, self.classes, self.size, self.seed)
        return train


@dataclass(frozen=True)
class PublicModel:
    """A public pre-trained network: registry name, constructor arguments, weights."""

    name: str
    num_classes: int
    in_channels: int
    kwargs: dict = field(default_factory=dict)
    state: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def build(self) -> torch.nn.Module:
        model = build_model(self.name, self.num_classes, self.in_channels, **self.kwargs)
        model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in self.state.items()})
        return model


@dataclass(frozen=True)
class FinetuneResult:
    """What leaves the actor: DP weights and their cost (nothing else about the private data)."""

    variant: str
    state: dict[str, np.ndarray] = field(repr=False)
    epsilons: list[float]
    noise_multiplier: float
    sample_rate: float
    steps: int
    trained_entries: int
    total_entries: int
    budget: BudgetReport


class SparseTrainer:
    """Holds the private transfer set and fine-tunes public models on it with DP-SGD.

    Every fine-tuning is charged to the ledger at ``ledger_path`` (with the ``budget`` the
    driver declared) before it starts; a run the budget cannot afford raises
    ``BudgetExceeded`` and trains nothing.
    """

    def __init__(
        self, source: TransferSource, ledger_path: str, delta: float, budget: RenyiFilter | None,
        noise: NoisePolicy, torch_threads: int = 1,
    ) -> None:
        torch.set_num_threads(max(1, torch_threads))
        self._data = source.load()
        self._ledger = PrivacyLedger(ledger_path, delta, budget)
        self._delta = delta
        self._noise = noise

    def size(self) -> int:
        return len(self._data)

    def num_classes(self) -> int:
        return self._data.num_classes

    def finetune(
        self,
        public: PublicModel,
        variant: str,
        fraction: float,
        config: DPSGDConfig,
        classifier_seed: int = 0,
        progress: bool = False,
    ) -> FinetuneResult:
        """Fine-tune ``public`` with DP-SGD under ``variant`` (see ``learning.sparse``)."""
        if config.delta != self._delta:
            raise ValueError(f"DP-SGD delta {config.delta} must equal the ledger's delta {self._delta}")
        model = replace_classifier(public.build(), self._data.num_classes, seed=classifier_seed)
        plan = plan_variant(model, variant, fraction)
        schedule = dp_schedule(len(self._data), config, label=f"dpsgd-sparse-{variant}")
        report = self._ledger.charge(schedule.charge)  # before anything private is computed
        log.info("charged %s: ledger spend now ε %.4f", schedule.charge.label, report.epsilon_spent)
        result = train_dp(model, self._data, config, self._noise.source(f"dpsgd-sparse-{variant}"),
                          masks=plan.masks, progress=progress)
        state = {k: v.detach().cpu().numpy().copy() for k, v in result.model.state_dict().items()}
        return FinetuneResult(
            variant=variant,
            state=state,
            epsilons=result.epsilons,
            noise_multiplier=result.noise_multiplier,
            sample_rate=result.sample_rate,
            steps=result.steps,
            trained_entries=plan.trained_entries,
            total_entries=plan.total_entries,
            budget=report,
        )

    def close(self) -> None:
        self._ledger.close()


SparseTrainerActor = ray.remote(SparseTrainer)
