"""The library API: owners' data → a teacher ensemble → a private aggregator → a student.

The one import point for the pipelines' steps (``cluster.teaching``, active learning, sparse
fine-tuning) and for whole pipelines (``load_pipeline``, ``TeacherStudent`` …, then
``.validate()``, ``.plan()``, ``.run()``). ``examples/hospitals/library.py`` is the runnable
walk-through; docs/owners.md, "The library API".

It is also the front door for tuning and the benchmarks (``tests/test_import_graph.py``): configs
and tracking, Ray, the service's client, certificates, audits, public pre-training, and the
components a benchmark times alone. Each name is imported from its module on first use
(``EXPORTS``), so importing the door costs only what is taken through it: ``ConfigError`` loads
neither torch nor Ray.
"""
from __future__ import annotations

import importlib
from typing import Any

# Each exported name, by the module that defines it.
EXPORTS: dict[str, tuple[str, ...]] = {
    # Whole pipelines, and what a run gets and returns.
    "conclave.cluster.pipelines": ("DEMO_CONFIG", "Pipeline", "RunContext", "RunOutcome", "load_pipeline"),
    "conclave.cluster.pipelines.active_learning": ("ActiveLearning",),
    "conclave.cluster.pipelines.sparse_finetune": ("SparseFinetune",),
    "conclave.cluster.pipelines.teacher_student": ("TeacherStudent",),
    # Configs, results folders and how a run is recorded.
    "conclave.cluster.config": ("ConfigError", "from_dict", "load_yaml"),
    "conclave.cluster.results": ("RunDirectory",),
    "conclave.cluster.run_privacy": ("PrivacyConfig",),
    "conclave.cluster.tracking": ("MlflowLog", "TrackingConfig", "TrackingFailed", "add_flag", "with_flag"),
    "conclave.learning.data.sources": ("DataSource",),
    "conclave.learning.train_config": ("TrainConfig",),
    "conclave.privacy.accounting.owner_policy": ("OwnerBudget",),
    # The teacher/student steps.
    "conclave.cluster.teaching.config": (
        "DEFAULT_TABLE_STUDENT", "KnnConfig", "MechanismConfig", "OwnerConfig", "StudentConfig", "TeachersConfig",
        "TeacherStudentConfig", "TeacherStudentData"),
    "conclave.cluster.teaching.ensemble": (
        "Ensemble", "PublicData", "public_data", "teacher_pool", "teacher_source", "train_ensemble", "train_teachers"),
    "conclave.cluster.teaching.clusters": ("cluster_vote_source",),
    "conclave.cluster.teaching.aggregation": ("Aggregator", "serve"),
    "conclave.cluster.teaching.student": ("StudentResult", "non_private_ceiling", "train_student"),
    "conclave.cluster.proposal": (
        "CHOICES", "DPSGD", "SOURCES", "TABLE_MODELS", "Proposal", "propose", "proposed_config", "smallest_sigma"),
    # Active learning and sparse fine-tuning.
    "conclave.cluster.active_learning": (
        "ActiveLearningConfig", "ActiveLearningData", "ActiveLearningDPSGD", "ActiveLearningResult", "AnnotatorConfig",
        "FinetuneConfig", "SelectionConfig", "learn_actively"),
    "conclave.cluster.sparse_finetuning": (
        "PretrainConfig", "PublicPretraining", "SparseConfig", "SparseResult", "finetune_sparsely", "pretrain_public"),
    "conclave.cluster.auditing": ("AuditSettings",),
    # Owners, and the coordinator's side of their gateways.
    "conclave.cluster.owners": ("DataOwner",),
    "conclave.actors.vote_parties": ("declared_share",),
    "conclave.cluster.gateway.client": ("ClusterVotes", "CoordinatorTls", "GatewayVoteSource", "OwnerGateway"),
    "conclave.cluster.gateway.identity": ("Verifier",),
    "conclave.cluster.gateway.local": ("LocalGateways",),
    # The aggregator service over any vote source, and what its clients see of it; teachers trained
    # on a Ray pool or in one process.
    "conclave.actors.aggregator": ("RECORD_UNWRITABLE", "SERVICE_NAME", "AggregatorServer", "ServerSettings"),
    "conclave.actors.labeller": ("input_keys",),
    "conclave.actors.teacher": ("TeacherGroup", "TeacherPool", "TeacherSource"),
    "conclave.cluster.client": ("AggregatorClient", "is_budget_refusal"),
    # Ray and certificates.
    "conclave.cluster.ray_runtime": ("gpus_available", "reclaim_orphaned_ray", "start_ray", "stop_ray"),
    "conclave.cluster.tls": ("Authority", "create_authority", "issue"),
}
_MODULE_OF = {name: module for module, names in EXPORTS.items() for name in names}
__all__ = list(_MODULE_OF)


def __getattr__(name: str) -> Any:
    """``name`` from the module that defines it, imported now (PEP 562); kept for the next use."""
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
