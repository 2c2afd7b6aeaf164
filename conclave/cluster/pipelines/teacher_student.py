"""The main job: private shards → teacher actors → gRPC aggregator → student → ε report.

``TeacherStudent`` checks a config, runs the library steps (``cluster.teaching``) and writes the
results folder: the student asks the aggregator over gRPC like any outside client, the ledger is
charged before each release, and ``privacy.json`` carries the guarantee, estimates labelled as
such, and nothing computed from the votes without a mechanism. docs/main-job.md.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from conclave.cluster.pipelines import OwnersData, Pipeline, RunContext, RunOutcome
from conclave.cluster.results import RunDirectory
from conclave.cluster.teaching.aggregation import check_port_free, serve
from conclave.cluster.teaching.config import TeacherStudentConfig
from conclave.cluster.teaching.ensemble import Ensemble, checked_public, resolved, train_ensemble
from conclave.cluster.teaching.rounds import earlier_rounds, with_earlier_rounds, with_lineage
from conclave.cluster.teaching.service import Service
from conclave.cluster.teaching.student import StudentResult, train_student
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.ledger import BudgetExceeded

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TeacherStudent(Pipeline[TeacherStudentConfig, StudentResult]):
    """``pipeline: teacher_student``: teachers (or records that vote) → private aggregator → student."""

    name: ClassVar[str] = "teacher_student"
    config_type: ClassVar[type] = TeacherStudentConfig
    config: TeacherStudentConfig

    def plan(self) -> PrivacyCharge:
        return self.config.planned()

    def unused_settings(self) -> tuple[str, ...]:
        """The keys this run does not read: beside owners, the benchmark's data keys (the sources
        say what they said; ``data.features`` stays); without owners, the owners' sections."""
        if self.config.owners:
            return ("data.name", "data.root", "data.public_size", "data.private_size")
        return ("owners", "public", "test", "classes")

    def validate(self) -> TeacherStudent:
        """Its public data and the models for those inputs; the config with its defaults resolved."""
        return self.with_config(resolved(self.config, checked_public(self.config)))

    def owners_data(self) -> OwnersData:
        config = self.config
        return OwnersData(config.owners, config.public, config.test, config.classes,
                          {owner.name: owner.teachers for owner in config.owners})

    def service(self, **overrides: Any) -> Service:
        """What ``conclave serve`` starts: this config served, with ``overrides`` of its server's
        fields (None: the config's). Its answers are always releases: its noise comes from OS
        entropy (``ConfigError`` otherwise). A service publishes no run report, so it releases no
        smooth-sensitivity estimate and reserves nothing for one."""
        config = self.config
        config.privacy.require_os_entropy("serving")
        if config.estimates.smooth_sensitivity:
            log.info("serve publishes no run report: estimates.smooth_sensitivity is not released or charged")
            config = dataclasses.replace(config, estimates=dataclasses.replace(config.estimates,
                                                                              smooth_sensitivity=False))
        return Service(config, overrides)

    def run(self, context: RunContext) -> RunOutcome[StudentResult]:
        config = self.config
        check_port_free(config.server.host, config.server.port)  # a fixed port taken: found before training
        # With owners, each owner's gateway admits the run by its policy, and can pay for one round, before
        # its teachers train (the student stops at a budget).
        with train_ensemble(config, context.ray_address) as ensemble:
            return self.teach(ensemble, context.results)

    def teach(self, teachers: Ensemble, results: RunDirectory) -> RunOutcome[StudentResult]:
        """Serve ``teachers`` over gRPC, let a student actor learn from them, write the results.

        Separate from ``run`` so one set of trained teachers can serve several mechanisms
        (the benchmark does this for the three 250-teacher MNIST configs).
        """
        config = resolved(self.config, teachers.public)
        earlier = earlier_rounds(config)  # the rounds behind a network embedding compose with this one
        with serve(config, teachers, results.path / "ledger.sqlite") as aggregator:
            student = train_student(config, teachers, aggregator)
            aggregator.stop()
            charged = aggregator.ledger.worst_case_spent()  # the plan's worst case no longer covers a run past it
            privacy = with_earlier_rounds(aggregator.privacy_report(), config, earlier, charged)
            stopped = (aggregator.ledger.last_refusal or "a privacy budget refused the next answer"
                       ) if student.budget_exhausted else None
        if stopped is not None and not student.asked:  # nothing asked was paid for: a refusal, not a result
            raise BudgetExceeded(stopped)
        if stopped is not None:
            privacy = privacy.adding(stopped_by_budget=stopped)
        # No seconds or rates: the teachers' training, the votes (kNN: over every record) and the
        # analysis of the votes take times that grow with the owners' records (docs/privacy.md).
        metrics = {
            "student_accuracy": student.accuracy,
            "label_accuracy": student.label_accuracy,  # released labels against the pool's truth (None: no labels)
            "queries_asked": student.asked,
            "queries_answered": student.answered,
            "budget_exhausted": student.budget_exhausted,
            **config.vote_source.described(config, teachers.pool),
            "curve": _run_curve(student.curve),
        }
        results.write_json("metrics", metrics)
        results.write_json("privacy", privacy.as_dict())
        if student.network is not None:  # a later round's embedding: "network:<this file>", with every round's bound
            with_lineage(student.network, config, earlier, charged).save(results.path / "student.pt")
        _plots(results, student.curve)
        summary = {
            "student_accuracy": round(student.accuracy, 4),
            "label_accuracy": None if student.label_accuracy is None else round(student.label_accuracy, 4),
            "queries_asked": student.asked,
            "queries_answered": student.answered,
            "epsilon": privacy.headline(),
        }
        if privacy.owners:
            summary["owners (lifetime budgets)"] = privacy.owners_line()
        if stopped is not None:
            summary[f"stopped after {student.answered} answers by"] = stopped
        return RunOutcome(student, privacy, metrics, summary)


def _run_curve(curve: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The student's curve with the service's spend and counters at each point, not the service's
    guarantee: the run's own service declares no budget of its own, so it would read "unbounded"
    beside a run whose guarantee (privacy.json) is its budget or its planned worst case."""
    return [{**point, "budget": {k: v for k, v in point["budget"].items() if k not in ("guarantee", "sound")}}
            for point in curve]


def _plots(results: RunDirectory, curve: list[dict[str, Any]]) -> None:
    answered = [p["answered"] for p in curve]
    results.plot("student_accuracy", answered, {"student": [p["accuracy"] for p in curve]},
                 xlabel="answered queries", ylabel="student test accuracy")
    epsilons = [float(p["budget"].get("epsilon_spent", math.nan)) for p in curve]
    if all(math.isfinite(e) for e in epsilons):
        results.plot("epsilon_spent", answered, {"realised spend (the guarantee is the budget)": epsilons},
                     xlabel="answered queries", ylabel="ε spent (ledger)")

