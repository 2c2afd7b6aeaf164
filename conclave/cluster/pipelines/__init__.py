"""Pipelines: one typed object per pipeline a config can name, which every client goes through.

    pipeline = load_pipeline(load_yaml("configs/hospitals.yaml"))    # TeacherStudent(config=...)
    pipeline = pipeline.validate()                  # its public data and models, before Ray starts
    pipeline.plan()                                 # the worst case of what it will release
    outcome = pipeline.run(RunContext("hospitals", RunDirectory("results", "hospitals")))
    outcome.result, outcome.privacy                 # typed: StudentResult, RunPrivacy

``conclave run``, ``plan``, ``serve``, ``audit`` and ``check-data``, tuning and the benchmarks
all load a config this way and use the pipeline's methods, never a pipeline's insides. A config
file names its ``pipeline`` (a key of ``PIPELINES``); the rest of it is that pipeline's config
dataclass, read by ``cluster.config.from_dict``.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from conclave.cluster.auditing import AuditResult, AuditSettings, run_audit
from conclave.cluster.config import ConfigError, from_dict, load_yaml
from conclave.cluster.owners import DataOwner, GatewaysConfig
from conclave.cluster.results import RunDirectory
from conclave.cluster.run_privacy import PrivacyConfig, RunPrivacy
from conclave.cluster.teaching.service import Service
from conclave.learning.data.sources import DataSource
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.guarantee import Guarantee
from conclave.registry import Registry



class PipelineConfig(Protocol):
    """What every pipeline's config holds besides its own sections."""

    @property
    def name(self) -> str: ...

    @property
    def privacy(self) -> PrivacyConfig: ...

    @property
    def owners(self) -> tuple[DataOwner, ...]: ...

    @property
    def runtime_env(self) -> dict: ...  # Ray's, for the run's workers

    @property
    def models(self) -> tuple: ...  # the models the run builds (names, "module:function" or factories)


ConfigT = TypeVar("ConfigT", bound=PipelineConfig)
ResultT = TypeVar("ResultT")
PipelineT = TypeVar("PipelineT", bound="Pipeline")

PIPELINES: Registry[type[Pipeline]] = Registry("pipeline", {
    "teacher_student": "conclave.cluster.pipelines.teacher_student:TeacherStudent",
    "active_learning": "conclave.cluster.pipelines.active_learning:ActiveLearning",
    "sparse_finetune": "conclave.cluster.pipelines.sparse_finetune:SparseFinetune",
})

# What ``conclave demo`` runs: public-cluster votes on scikit-learn's digits, one release. The file
# ships inside the package, so the demo needs no checkout; configs/demo.yaml links to it.
DEMO_CONFIG: Mapping[str, Any] = load_yaml(Path(__file__).with_name("demo.yaml"))


@dataclass(frozen=True)
class RunOutcome(Generic[ResultT]):
    """What a run returns: the library's typed ``result``, the privacy report it wrote to
    ``privacy.json``, what it wrote to ``metrics.json`` (``metrics``, the same figures as JSON)
    and the short ``summary`` the CLI prints (so callers need not read the files back)."""

    result: ResultT
    privacy: RunPrivacy
    metrics: dict[str, Any]
    summary: dict[str, Any]


@dataclass(frozen=True)
class RunContext:
    """What every run gets besides its config: its name, its results folder, the Ray cluster to join."""

    run_name: str
    results: RunDirectory
    ray_address: str | None = None


@dataclass(frozen=True)
class OwnersData:
    """What ``conclave check-data`` reads of a config: the owners, the public pool whose columns
    are the run's inputs (None: the pipeline has no pool), the test data, the class names, and
    each owner's teachers (empty where the pipeline trains none)."""

    owners: tuple[DataOwner, ...]
    public: DataSource | None
    test: DataSource | None
    classes: tuple[str, ...] | None
    teachers: Mapping[str, int]


class Pipeline(ABC, Generic[ConfigT, ResultT]):
    """One pipeline with its config (``config``, a frozen dataclass; subclasses are frozen
    dataclasses too). ``plan`` and ``validate`` read no private data and start nothing;
    ``run`` does the work and returns a typed outcome."""

    name: ClassVar[str]  # what a config's ``pipeline:`` says
    config_type: ClassVar[type]
    config: ConfigT

    def with_config(self: PipelineT, config: Any) -> PipelineT:
        """This pipeline with another config of its type (e.g. a sweep's trial, a plan's variation)."""
        return dataclasses.replace(self, config=config)

    def validate(self: PipelineT) -> PipelineT:
        """Everything the driver can check before Ray starts (``ConfigError``, one line): its public
        data, the models for those inputs. Returns the pipeline with its config's defaults resolved."""
        return self

    @abstractmethod
    def plan(self) -> PrivacyCharge:
        """The worst case of what a run will release, from public settings only: it fixes the
        budget's order and is the run's worst-case guarantee."""

    def guarantee(self) -> Guarantee:
        """What ``privacy.json`` will call the guarantee: the budget or the planned worst case,
        whichever is smaller."""
        return self.config.privacy.guarantee(self.plan())

    @abstractmethod
    def run(self, context: RunContext) -> RunOutcome[ResultT]:
        """Run the pipeline into ``context.results`` (metrics.json, privacy.json and plots)."""

    @abstractmethod
    def unused_settings(self) -> tuple[str, ...]:
        """The config's keys (dotted) this run does not read, which tracking leaves out of its params."""

    @abstractmethod
    def owners_data(self) -> OwnersData:
        """What ``conclave check-data`` reads of the config."""

    def service(self, **overrides: Any) -> Service:
        """What ``conclave serve`` starts: only a teacher_student pipeline has one."""
        raise ConfigError(f"config.pipeline: conclave serve needs a teacher_student config, got {self.name!r}")

    def audit(self, settings: AuditSettings) -> AuditResult:
        """An empirical lower bound on ε from one run with canaries, by the audit registered for
        this pipeline (``cluster.auditing.AUDITS``)."""
        return run_audit(self.name, self.config, settings)

    def as_dict(self) -> dict[str, Any]:
        """The config as ``config.json`` holds it: ``pipeline`` first, then its sections."""
        return {"pipeline": self.name, **dataclasses.asdict(self.config)}  # type: ignore[call-overload]


class OwnersDpsgdConfig(PipelineConfig, Protocol):
    """A config whose DP-SGD runs on the owners' records (active learning, sparse fine-tuning)."""

    @property
    def through_gateways(self) -> bool: ...

    @property
    def gateways(self) -> GatewaysConfig | None: ...


def planned_on_declared(config: OwnersDpsgdConfig,
                        planned_work: Callable[[OwnersDpsgdConfig, int | None], PrivacyCharge]) -> PrivacyCharge:
    """A DP-SGD pipeline's ``plan``: ``planned_work`` of the config on the records its owners declare.
    Behind gateways, the owners declare their records there: each gateway is asked (``Describe``);
    else the config's count (None)."""
    if config.through_gateways:
        from conclave.cluster.active_gateways import declared_records

        return planned_work(config, declared_records(config.owners, config.gateways))
    return planned_work(config, None)


def load_pipeline(raw: Mapping[str, Any]) -> Pipeline:
    """The pipeline a parsed YAML mapping describes (``ConfigError`` naming the key). Its
    ``tracking`` section says how the run is recorded, not what it does:
    ``conclave.cluster.tracking.from_section`` reads it."""
    raw = dict(raw)
    raw.pop("tracking", None)
    name = raw.pop("pipeline", None)
    if name is None:
        raise ConfigError("config: missing required key 'pipeline'")
    try:
        kind = PIPELINES.load(name)
    except KeyError as err:
        raise ConfigError(f"config.pipeline: {err.args[0]}") from err
    return kind(from_dict(kind.config_type, raw))  # type: ignore[call-arg]
