"""kNN votes in place of teachers (the ``knn`` section): the owners' records vote through their
nearest neighbours, held by actors on the owners' nodes (``actors.knn_votes``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from conclave.cluster.owners import PublicData
from conclave.cluster.run_privacy import KNN_AGGREGATOR
from conclave.cluster.teaching.config import KnnConfig, TeacherStudentConfig
from conclave.cluster.teaching.vote_source import VoteSource
from conclave.cluster.teaching.voting_records import (check_clean_votes_stay_home, check_gateway_embedding,
                                                      records_described, voting_records)
from conclave.privacy.mechanisms.private_knn import KNN_LEMMA

if TYPE_CHECKING:  # imported where used: loading a config needs neither torch nor Ray
    from conclave.actors.knn_votes import KnnVoteSource


class KnnSource(VoteSource[TeacherStudentConfig]):
    section: KnnConfig
    kind: ClassVar[str] = "knn"
    section_type: ClassVar[type] = KnnConfig
    lemma: ClassVar[str] = KNN_LEMMA
    trust = KNN_AGGREGATOR
    records_vote: ClassVar[bool] = True
    clean_votes: ClassVar[str] = "their neighbours' distances"
    paired: ClassVar[tuple[str, ...]] = ("sample_rate",)
    starting: ClassVar[str] = "starting the owners' kNN actors (each loads its owner's records)"

    def votes_per_query(self, config: TeacherStudentConfig) -> int:
        return self.section.k

    def check_gateway(self, config: TeacherStudentConfig) -> None:
        check_gateway_embedding(self)

    def work(self, config: TeacherStudentConfig, mechanism: str) -> str:
        student, knn = config.student, self.section
        return (f"{mechanism} on {student.queries} queries asked {student.batch_size} at a time; worst case: every "
                f"one answered; kNN votes, k {knn.k} of a Poisson sample at rate {knn.sample_rate:g}")

    def serving(self, pool: Any) -> str:
        return f"kNN votes, k {self.section.k} at sample rate {self.section.sample_rate:g}"

    def start(self, config: TeacherStudentConfig, public: PublicData, progress: bool) -> KnnVoteSource:
        """The owners' kNN shard actors, each holding its owner's records embedded on its node."""
        from conclave.actors.knn_votes import KnnVoteSource
        from conclave.progress import waiting

        knn = self.section
        with waiting(self.starting, progress):
            records = voting_records(config, knn, public)
            source = KnnVoteSource(records.shares, records.embed, knn.k, knn.sample_rate, noise=config.privacy.noise,
                                   num_cpus_per_actor=records.cpus_per_actor, local=config.secure)
        if not config.secure:
            check_clean_votes_stay_home(source, self.clean_votes)
        return source

    def gateway_terms(self, config: TeacherStudentConfig) -> tuple[Any, float, bool]:
        """One noised total per round: sigma1 = sigma2."""
        from conclave.cluster.gateway.client import KnnVotes

        knn = self.section
        return (KnnVotes(knn.k, knn.sample_rate, knn.embedding, knn.dims), float(config.mechanism.params["sigma1"]),
                True)

    def described(self, config: TeacherStudentConfig, pool: Any) -> dict[str, Any]:
        return records_described(self, pool)

