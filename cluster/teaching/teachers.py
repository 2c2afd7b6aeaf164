"""Teachers' votes (PATE; the ``teachers`` section, the default vote source): one teacher per disjoint
shard of the owners' records, trained on Ray actors on the owners' nodes (``actors.teacher``)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

from conclave.cluster.owners import PublicData
from conclave.cluster.run_privacy import TRUSTED_AGGREGATOR
from conclave.cluster.teaching.config import TeachersConfig, TeacherStudentConfig
from conclave.cluster.teaching.vote_source import VoteSource
from conclave.learning.data.dataset import SHARD_LEMMA

if TYPE_CHECKING:  # imported where used: loading a config needs neither torch nor Ray
    from conclave.actors.teacher import TeacherPool

log = logging.getLogger(__name__)


class TeachersSource(VoteSource[TeacherStudentConfig]):
    section: TeachersConfig
    kind: ClassVar[str] = "teachers"
    section_type: ClassVar[type] = TeachersConfig
    lemma: ClassVar[str] = SHARD_LEMMA
    trust = TRUSTED_AGGREGATOR
    starting: ClassVar[str] = "starting the teacher actors (each loads its shards)"

    def votes_per_query(self, config: TeacherStudentConfig) -> int:
        return config.num_teachers

    def check_gateway(self, config: TeacherStudentConfig) -> None:
        """Teachers trained behind the gateways: a registered model by name (a gateway runs no code
        a config names), and one σ for every round (the gateways admit one)."""
        from conclave.learning.models.registry import REGISTRY

        model, params = self.section.model, config.mechanism.params
        if not isinstance(model, str) or model not in REGISTRY:
            raise ValueError(f"teachers.model {model!r}: teachers behind gateways train a registered model "
                             "(a gateway runs no code a config names)")
        if config.mechanism.name == "confident-gnmax" and params.get("sigma1") != params.get("sigma"):
            raise ValueError("confident-gnmax through gateways: give sigma1 equal to sigma (the gateways admit "
                             "one σ for every round)")

    def work(self, config: TeacherStudentConfig, mechanism: str) -> str:
        student = config.student
        return (f"{mechanism} on {student.queries} queries asked {student.batch_size} at a time; worst case: every "
                "one answered")

    def serving(self, pool: TeacherPool) -> str:
        return f"{pool.votes_per_query} teachers"

    def start(self, config: TeacherStudentConfig, public: PublicData, embedded: bool, progress: bool) -> TeacherPool:
        from conclave.cluster.teaching.ensemble import teacher_pool
        from conclave.progress import waiting

        with waiting(self.starting, progress):
            pool = teacher_pool(config, public, embedded=embedded)
        try:
            pool.train(progress=progress)
        except BaseException:
            pool.shutdown()
            raise
        # No time in the log or the results: it grows with the private records each teacher holds.
        log.info("teachers: %d trained on %d actors", pool.num_teachers, pool.num_actors)
        return pool

    def gateway_terms(self, config: TeacherStudentConfig) -> tuple[Any, float, bool]:
        """Teachers trained behind each gateway, on its owner's records only: no pool goes there."""
        from conclave.cluster.gateway.client import TeacherVotes

        train = self.section.train
        terms = TeacherVotes(tuple(owner.teachers for owner in config.owners), self.section.model, train.epochs,
                             train.batch_size, train.lr, config.seed)
        return terms, float(config.mechanism.params["sigma"]), False

    def described(self, config: TeacherStudentConfig, pool: TeacherPool) -> dict[str, Any]:
        from conclave.learning.models import model_label

        return {"teachers": {"count": pool.num_teachers, "actors": pool.num_actors,
                             "model": model_label(self.section.model), "nodes": pool.placement}}
