"""Pipelines a config can name. Each module exposes ``Config`` (a frozen dataclass) and
``run(config: Config, context: RunContext) -> dict`` returning the run's summary."""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from cluster.results import RunDirectory
from privacy.accounting.ledger import PrivacyLedger

PIPELINES = {
    "teacher_student": "cluster.pipelines.teacher_student",
    "active_learning": "cluster.pipelines.active_learning",
    "sparse_finetune": "cluster.pipelines.sparse_finetune",
}


@dataclass
class RunContext:
    """What every pipeline gets besides its config."""

    run_name: str
    results: RunDirectory
    ray_address: str | None = None


@dataclass(frozen=True)
class PrivacyConfig:
    """A config's ``privacy`` section: the run ledger's ε limit and δ."""

    epsilon_limit: float | None = None  # null: a report-only ledger (it refuses nothing)
    delta: float = 1e-5

    def __post_init__(self) -> None:
        if self.epsilon_limit is not None and not self.epsilon_limit > 0:
            raise ValueError(f"privacy.epsilon_limit must be > 0 or null, got {self.epsilon_limit}")
        if not 0 < self.delta < 1:
            raise ValueError(f"privacy.delta must be in (0, 1), got {self.delta}")

    @property
    def ledger_limit(self) -> float:
        """The limit as the ledger takes it: inf for a report-only ledger."""
        return math.inf if self.epsilon_limit is None else self.epsilon_limit

    def open_ledger(self, path: str | Path) -> PrivacyLedger:
        return PrivacyLedger(path, epsilon_limit=self.ledger_limit, delta=self.delta)


def pipeline_module(name: str) -> ModuleType:
    if name not in PIPELINES:
        raise KeyError(f"unknown pipeline {name!r}; known: {sorted(PIPELINES)}")
    return importlib.import_module(PIPELINES[name])
