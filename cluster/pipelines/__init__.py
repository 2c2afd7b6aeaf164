"""Pipelines a config can name: YAML → library adapters. Each module exposes ``Config`` (a frozen
dataclass), ``validate(config) -> Config`` (what the driver checks before Ray starts, one-line
``ConfigError``s; the config with its defaults resolved), ``run(config: Config, context:
RunContext) -> RunOutcome`` (what it wrote, as values), ``planned_work(config) ->
PrivacyCharge``: the worst case of what the run will release, from public settings only (it
fixes the budget's order and is the run's worst-case guarantee), and ``unused_settings(config)
-> tuple[str, ...]``: the config's keys (dotted) that this run does not read, which tracking
leaves out of its params."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from conclave.cluster.results import RunDirectory
from conclave.cluster.run_privacy import RunPrivacy
from conclave.registry import Registry

PIPELINES: Registry[ModuleType] = Registry("pipeline", {
    "teacher_student": "conclave.cluster.pipelines.teacher_student",
    "active_learning": "conclave.cluster.pipelines.active_learning",
    "sparse_finetune": "conclave.cluster.pipelines.sparse_finetune",
})


@dataclass(frozen=True)
class RunOutcome:
    """What a run returns: the short summary the CLI prints, and the metrics and privacy
    report it wrote to ``metrics.json`` and ``privacy.json`` (so callers need not read them back)."""

    summary: dict[str, Any]
    metrics: dict[str, Any]
    privacy: RunPrivacy


@dataclass
class RunContext:
    """What every pipeline gets besides its config."""

    run_name: str
    results: RunDirectory
    ray_address: str | None = None


def pipeline_module(name: str) -> ModuleType:
    """The pipeline module ``name`` (``UnknownName``, a KeyError naming the known ones, if none)."""
    return PIPELINES.load(name)
