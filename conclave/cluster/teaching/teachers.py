"""Teachers' votes (PATE; the ``teachers`` section, the default vote source): one teacher per disjoint
shard of the records, trained on Ray actors (``actors.teacher``): the benchmark's in the cluster, each
owner's behind its gateway."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

from conclave.cluster.owners import PublicData
from conclave.cluster.run_privacy import TRUSTED_AGGREGATOR
from conclave.cluster.teaching.config import TeachersConfig, TeacherStudentConfig
from conclave.cluster.teaching.vote_source import VoteSource
from conclave.errors import InvalidValue
from conclave.learning.data.dataset import SHARD_LEMMA

if TYPE_CHECKING:  # imported where used: loading a config needs neither torch nor Ray
    from conclave.actors.teacher import TeacherPool

log = logging.getLogger(__name__)


def one_sigma(config: TeacherStudentConfig) -> float | None:
    """The σ the gateways admit for teachers' rounds: GNMax's, or Confident-GNMax's answers' (``sigma2``,
    or its alias ``sigma``), which its threshold's must equal."""
    params = config.mechanism.params
    return params.get("sigma", params.get("sigma2"))


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
        """Teachers trained behind the gateways: one σ for every round (the gateways admit one); the
        model, a registered one by name, is checked with the models, before Ray starts (``check_models``:
        the registry imports torch, which loading a config does not)."""
        if config.mechanism.name == "confident-gnmax" and config.mechanism.params.get("sigma1") != one_sigma(config):
            raise InvalidValue("confident-gnmax through gateways: give sigma1 equal to sigma (sigma2, the answers' σ): the "
                             "gateways admit one σ for every round")

    def work(self, config: TeacherStudentConfig, mechanism: str) -> str:
        student = config.student
        return (f"{mechanism} on {student.queries} queries asked {student.batch_size} at a time; worst case: every "
                "one answered")

    def serving(self, pool: TeacherPool) -> str:
        return f"{pool.votes_per_query} teachers"

    def start(self, config: TeacherStudentConfig, public: PublicData, progress: bool) -> TeacherPool:
        from conclave.cluster.teaching.ensemble import teacher_pool
        from conclave.progress import waiting

        with waiting(self.starting, progress):
            pool = teacher_pool(config, public)
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
        return terms, float(one_sigma(config)), False

    def described(self, config: TeacherStudentConfig, pool: TeacherPool) -> dict[str, Any]:
        from conclave.learning.models import model_label

        return {"teachers": {"count": pool.num_teachers, "actors": pool.num_actors,
                             "model": model_label(self.section.model), "nodes": pool.placement}}
