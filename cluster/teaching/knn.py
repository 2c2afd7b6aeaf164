"""kNN votes in place of teachers (the ``knn`` section): the owners' records vote through their
nearest neighbours, held by actors on the owners' nodes (``actors.knn_votes``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from conclave.cluster.owners import PublicData
from conclave.cluster.teaching.config import TeacherStudentConfig
from conclave.cluster.teaching.voting_records import check_clean_votes_stay_home, voting_records

if TYPE_CHECKING:  # imported where used: loading a config needs neither torch nor Ray
    from conclave.actors.knn_votes import KnnVoteSource


def knn_vote_source(config: TeacherStudentConfig, public: PublicData, embedded: bool = True) -> KnnVoteSource:
    """The owners' kNN shard actors, each holding its owner's records embedded on its node (Ray
    must be running)."""
    from conclave.actors.knn_votes import KnnVoteSource

    knn = config.knn
    records = voting_records(config, knn, public, embedded)
    source = KnnVoteSource(records.shares, records.embed, knn.k, knn.sample_rate, noise=config.privacy.noise,
                           num_cpus_per_actor=records.cpus_per_actor, local=config.secure)
    if not config.secure:
        check_clean_votes_stay_home(source, "their neighbours' distances")
    return source
