"""Pipelines a config can name. Each module exposes ``Config`` (a frozen dataclass) and
``run(config: Config, context: RunContext) -> dict`` returning the run's summary."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from cluster.results import RunDirectory

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


def pipeline_module(name: str) -> ModuleType:
    if name not in PIPELINES:
        raise KeyError(f"unknown pipeline {name!r}; known: {sorted(PIPELINES)}")
    return importlib.import_module(PIPELINES[name])
