"""Public-cluster votes in place of teachers (the ``clusters`` section): the owners' records vote,
with their labels, for their m nearest medoids of the public pool's clusters, held by actors on the
owners' nodes (``actors.cluster_votes``)."""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, ClassVar

from conclave.cluster.owners import PublicData
from conclave.cluster.run_privacy import CLUSTER_AGGREGATOR
from conclave.cluster.teaching.config import ClustersConfig, StudentConfig, TeacherStudentConfig
from conclave.cluster.teaching.vote_source import VoteSource
from conclave.cluster.teaching.voting_records import (check_clean_votes_stay_home, check_gateway_embedding,
                                                      records_described, voting_records)
from conclave.errors import InvalidValue
from conclave.learning.selection import CLUSTERS
from conclave.privacy.mechanisms import MECHANISMS
from conclave.privacy.mechanisms.public_clusters import CLUSTER_LEMMA

if TYPE_CHECKING:  # imported where used: loading a config needs neither torch nor Ray
    from conclave.actors.cluster_votes import ClusterVoteSource

log = logging.getLogger(__name__)


class ClustersSource(VoteSource[TeacherStudentConfig]):
    section: ClustersConfig
    kind: ClassVar[str] = "clusters"
    section_type: ClassVar[type] = ClustersConfig
    lemma: ClassVar[str] = CLUSTER_LEMMA
    trust = CLUSTER_AGGREGATOR
    records_vote: ClassVar[bool] = True
    clean_votes: ClassVar[str] = "each owner's vote histogram"
    paired: ClassVar[tuple[str, ...]] = ("votes_per_record",)
    asks_in_embedding: ClassVar[bool] = True  # the medoids, found in the source's embedding of the pool
    starting: ClassVar[str] = "starting the owners' cluster-vote actors (each loads its owner's records)"

    def votes_per_query(self, config: TeacherStudentConfig) -> int:
        return config.num_teachers

    def check(self, config: TeacherStudentConfig) -> None:
        if not set(self.paired) <= set(config.mechanism.paired_with):
            paired = [name for name, cls in MECHANISMS.items() if set(self.paired) <= set(cls.paired_with)]
            raise InvalidValue(f"clusters votes are charged once per batch by mechanism {', '.join(paired)}, not "
                             f"{config.mechanism.name}")

    def asked(self, config: TeacherStudentConfig) -> StudentConfig:
        """The student asks the ``clusters.count`` medoids in one call (one release), then learns."""
        count = self.section.count
        if count > config.server.max_batch:
            raise InvalidValue(f"clusters.count ({count}) exceeds server.max_batch ({config.server.max_batch}): the "
                             "medoids are asked in one batch")
        student = config.student
        asked = dataclasses.replace(student, queries=count, batch_size=count, checkpoints=(),
                                    selection=dataclasses.replace(student.selection, strategy=CLUSTERS,
                                                                  round_size=count))
        if (student.queries, student.batch_size) != (asked.queries, asked.batch_size) and \
                student.selection.strategy == CLUSTERS:
            log.warning("student.queries and batch_size are the clusters' count (%d) with clusters votes", count)
        return asked

    def check_gateway(self, config: TeacherStudentConfig) -> None:
        check_gateway_embedding(self)

    def work(self, config: TeacherStudentConfig, mechanism: str) -> str:
        return (f"{mechanism} on the medoids of {self.section.count} clusters of the pool, asked in one batch: each "
                f"record votes for its {self.section.votes_per_record} nearest, one release")

    def serving(self, pool: Any) -> str:
        return f"public-cluster votes, each record for its {self.section.votes_per_record} nearest queries of a call"

    def start(self, config: TeacherStudentConfig, public: PublicData, progress: bool) -> ClusterVoteSource:
        from conclave.progress import waiting

        with waiting(self.starting, progress):
            return cluster_vote_source(config, public)

    def gateway_terms(self, config: TeacherStudentConfig) -> tuple[Any, float, bool]:
        from conclave.cluster.gateway.client import ClusterVotes

        section = self.section
        return (ClusterVotes(section.votes_per_record, section.embedding, section.dims),
                float(config.mechanism.params["sigma"]), True)

    def described(self, config: TeacherStudentConfig, pool: Any) -> dict[str, Any]:
        return records_described(self, pool)


def cluster_vote_source(config: TeacherStudentConfig, public: PublicData) -> ClusterVoteSource:
    """The owners' cluster-vote actors of ``config``'s clusters section, each holding its owner's
    records embedded on its node (Ray must be running)."""
    from conclave.actors.cluster_votes import ClusterVoteSource

    section = config.vote_source.section
    records = voting_records(config, section, public)
    source = ClusterVoteSource(records.shares, records.embed, section.votes_per_record,
                               num_cpus_per_actor=records.cpus_per_actor)
    if not config.secure:
        check_clean_votes_stay_home(source, "their records' vote histogram")
    return source
