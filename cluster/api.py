"""The library API: owners' data → a teacher ensemble → a private aggregator → a student.

    from conclave.cluster.api import DataSource, OwnerConfig, TeacherStudentConfig, serve, train_ensemble, train_student

    config = TeacherStudentConfig(
        name="hospitals",
        owners=(OwnerConfig("hospital_a", DataSource("csv", "/data/a.csv", label="diagnosis"),
                            teachers=10, resources={"hospital_a": 1}), ...),
        public=DataSource("csv", "pool.csv"), test=DataSource("csv", "test.csv", label="diagnosis"))
    with train_ensemble(config) as ensemble:                          # teachers, on their owners' nodes
        with serve(config, ensemble, "ledger.sqlite") as aggregator:  # gRPC on 127.0.0.1, ledger-gated
            student = train_student(config, ensemble, aggregator)     # StudentResult
            report = aggregator.privacy_report()                      # the guarantee first

With ``knn=KnnConfig(...)`` (and ``MechanismConfig("private-knn", ...)``) ``train_ensemble`` trains
nothing: it starts kNN actors on the owners' nodes, and the records vote themselves.

A whole pipeline is one typed object (``cluster.pipelines``): ``load_pipeline(raw)`` (or
``TeacherStudent(config)``, ``ActiveLearning(config)``, ``SparseFinetune(config)``), then
``.validate()``, ``.plan()`` and ``.run(RunContext(...))`` → a typed ``RunOutcome``: what
``conclave run``, ``plan``, ``serve``, ``audit`` and ``check-data``, tuning and the benchmarks use.

Each step returns a typed result; the steps live in ``cluster.teaching`` (config, ensemble,
aggregation, student) and this module is their one import point, as it is for the other two
pipelines' steps: ``learn_actively(ActiveLearningConfig(...), results)`` → ``ActiveLearningResult``
(its sections: ``ActiveLearningData``, ``ActiveLearningDPSGD``, ``SelectionConfig``,
``FinetuneConfig``, ``AnnotatorConfig``) and ``finetune_sparsely(SparseConfig(...), results)`` →
``SparseResult``. A model may be a ``learning.models`` name, ``"module:function"``, or the factory
itself (``TeachersConfig(model=my_factory)``): Ray sends a function of the script that runs by
value and ships the package of any other (``cluster.ray_runtime.with_models``).
``examples/hospitals/library.py`` is the runnable version of the lines above.

It is also the front door for tuning and the benchmarks (``tests/test_import_graph.py``): Ray
(``start_ray``), the service's client (``AggregatorClient``), certificates (``create_authority``,
``issue``), audits (``AuditSettings``), the vote sources ``conclave plan --propose`` knows
(``SOURCES``) and public pre-training (``pretrain_public``).
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
from conclave.cluster.proposal import SOURCES
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
from conclave.cluster.teaching.student import StudentResult, train_student
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
    "TrainConfig", "serve", "train_ensemble", "train_student",
    "AuditSettings", "DEFAULT_TABLE_STUDENT", "PretrainConfig", "SOURCES", "pretrain_public",
    "AggregatorClient", "is_budget_refusal", "Authority", "create_authority", "issue",
    "gpus_available", "start_ray", "stop_ray",
]
