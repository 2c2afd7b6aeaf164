"""What a sweep is: a YAML file loaded into ``TuneConfig``.

A sweep names its ``kind`` (which knobs it explores and how trials run, see
``tuning.trainables.KINDS``), a ``base`` run config (the same YAML a ``conclave run``
takes, for the kind's pipeline) and a ``space``: dotted keys of ``base`` → a search
domain (see ``tuning.spaces``). Every trial is the base config with the space's values
put in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from conclave.cluster.api import TrackingConfig, from_dict, load_yaml
from conclave.errors import InvalidValue

@dataclass(frozen=True)
class SchedulerConfig:
    """``fifo`` runs every trial to the end; ``asha`` (asynchronous successive halving)
    stops the worse half early — only for kinds whose trials report every epoch."""

    name: Literal["fifo", "asha"] = "fifo"
    grace_period: int = 1  # epochs every trial gets before ASHA may stop it
    reduction_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.grace_period < 1 or self.reduction_factor <= 1:
            raise InvalidValue("scheduler.grace_period must be >= 1 and scheduler.reduction_factor > 1")


@dataclass(frozen=True)
class ResourcesConfig:
    """What one trial reserves. ``gpu`` may be a fraction (trials share a GPU) and is used
    only when the cluster has GPUs. Kinds whose pipeline starts its own actors ignore
    ``cpu``: those actors ask the cluster for what they need."""

    cpu: float = 1.0
    gpu: float = 0.0

    def __post_init__(self) -> None:
        if self.cpu <= 0 or self.gpu < 0:
            raise InvalidValue(f"resources.cpu must be > 0 and resources.gpu >= 0, got {self.cpu}, {self.gpu}")


@dataclass(frozen=True)
class CostConfig:
    """How the sweep's privacy cost is bounded (``privacy.accounting.tuning_cost``).

    ``composition`` — any sweep: the sum of every trial's charge; the whole table may be
    published. ``random-repetition`` — the number of trials is drawn from the truncated
    negative binomial (η, γ) instead of ``num_samples`` (Papernot & Steinke 2022, Thm 2);
    only the winner may be published; random search only (no grid, no ASHA) and no
    privacy setting may be swept. Free kinds (diverse_public) ignore this section."""

    method: Literal["composition", "random-repetition"] = "composition"
    eta: float = 1.0
    gamma: float = 0.2

    def __post_init__(self) -> None:
        if not self.eta > -1 or not 0 < self.gamma < 1:
            raise InvalidValue(f"cost: eta must be > -1 and gamma in (0, 1), got {self.eta}, {self.gamma}")


@dataclass(frozen=True)
class TuneConfig:
    name: str
    kind: Literal["near_private", "diverse_public", "sparsity", "teacher_ensemble"]
    base: dict  # a run config of the kind's pipeline (`pipeline:` key included)
    space: dict  # dotted key → domain, see tuning.spaces
    num_samples: int = 1  # samples of the space (each grid point this many times)
    max_concurrent_trials: int | None = None
    seed: int = 0  # the search's random state (which points are sampled; K's draw)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)  # MLflow (cluster.tracking)

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise InvalidValue(f"num_samples must be >= 1, got {self.num_samples}")
        if self.max_concurrent_trials is not None and self.max_concurrent_trials < 1:
            raise InvalidValue(f"max_concurrent_trials must be >= 1 or null, got {self.max_concurrent_trials}")
        if not self.space:
            raise InvalidValue("space: a sweep needs at least one key to vary")
        if "pipeline" not in self.base:
            raise InvalidValue("base: missing required key 'pipeline' (the run config of the kind's pipeline)")


def load_tune_config(path: str | Path) -> TuneConfig:
    """A ``TuneConfig`` from a YAML file; ``ConfigError`` names the offending key."""
    return from_dict(TuneConfig, load_yaml(path), where=Path(path).name)
