"""The library API: owners' data → a teacher ensemble → a private aggregator → a student.

The one import point for the pipelines' steps (``cluster.teaching``, active learning, sparse
fine-tuning) and for whole pipelines (``load_pipeline``, ``TeacherStudent`` …, then
``.validate()``, ``.plan()``, ``.run()``). ``examples/hospitals/library.py`` is the runnable
walk-through; docs/owners.md, "The library API".

It is also the front door for tuning and the benchmarks (``tests/test_import_graph.py``):
Ray (``start_ray``), the service's client, certificates, audits and public pre-training.
"""
from __future__ import annotations

from conclave.cluster.active_learning import (
    ActiveLearningConfig, ActiveLearningData, ActiveLearningDPSGD, ActiveLearningResult, AnnotatorConfig,
    FinetuneConfig, SelectionConfig, learn_actively,
)
from conclave.cluster.auditing import AuditSettings
from conclave.cluster.client import AggregatorClient, is_budget_refusal
from conclave.cluster.pipelines import DEMO_CONFIG, Pipeline, RunContext, RunOutcome, load_pipeline
from conclave.cluster.pipelines.active_learning import ActiveLearning
from conclave.cluster.pipelines.sparse_finetune import SparseFinetune
from conclave.cluster.pipelines.teacher_student import TeacherStudent
from conclave.cluster.proposal import CHOICES, SOURCES
from conclave.cluster.ray_runtime import gpus_available, start_ray, stop_ray
from conclave.cluster.results import RunDirectory
from conclave.cluster.run_privacy import PrivacyConfig
from conclave.cluster.sparse_finetuning import (
    PretrainConfig, PublicPretraining, SparseConfig, SparseResult, finetune_sparsely, pretrain_public,
)
from conclave.cluster.teaching.aggregation import Aggregator, serve
from conclave.cluster.teaching.config import (
    DEFAULT_TABLE_STUDENT, KnnConfig, MechanismConfig, OwnerConfig, StudentConfig, TeachersConfig, TeacherStudentConfig,
    TeacherStudentData,
)
from conclave.cluster.teaching.ensemble import Ensemble, PublicData, train_ensemble
from conclave.cluster.teaching.student import StudentResult, non_private_ceiling, train_student
from conclave.cluster.tls import Authority, create_authority, issue
from conclave.learning.data.sources import DataSource
from conclave.learning.train_config import TrainConfig

__all__ = [
    "ActiveLearning", "DEMO_CONFIG", "Pipeline", "RunContext", "RunOutcome", "SparseFinetune", "TeacherStudent",
    "load_pipeline",
    "ActiveLearningConfig", "ActiveLearningData", "ActiveLearningDPSGD", "ActiveLearningResult", "AnnotatorConfig",
    "FinetuneConfig", "SelectionConfig", "PublicPretraining", "RunDirectory", "SparseConfig", "SparseResult",
    "finetune_sparsely", "learn_actively",
    "Aggregator", "DataSource", "Ensemble", "KnnConfig", "MechanismConfig", "OwnerConfig", "PrivacyConfig",
    "PublicData", "StudentConfig", "StudentResult", "TeacherStudentConfig", "TeacherStudentData", "TeachersConfig",
    "TrainConfig", "non_private_ceiling", "serve", "train_ensemble", "train_student",
    "AuditSettings", "CHOICES", "DEFAULT_TABLE_STUDENT", "PretrainConfig", "SOURCES", "pretrain_public",
    "AggregatorClient", "is_budget_refusal", "Authority", "create_authority", "issue",
    "gpus_available", "start_ray", "stop_ray",
]
