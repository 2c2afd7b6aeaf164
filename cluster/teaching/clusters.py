"""Public-cluster votes in place of teachers (the ``clusters`` section): the owners' records vote,
with their labels, for their m nearest medoids of the public pool's clusters, held by actors on the
owners' nodes (``actors.cluster_votes``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from conclave.cluster.owners import PublicData
from conclave.cluster.teaching.config import TeacherStudentConfig
from conclave.cluster.teaching.voting_records import check_clean_votes_stay_home, voting_records

if TYPE_CHECKING:  # imported where used: loading a config needs neither torch nor Ray
    from conclave.actors.cluster_votes import ClusterVoteSource


def cluster_vote_source(config: TeacherStudentConfig, public: PublicData, embedded: bool = True) -> ClusterVoteSource:
    """The owners' cluster-vote actors, each holding its owner's records embedded on its node (Ray
    must be running)."""
    from conclave.actors.cluster_votes import ClusterVoteSource

    records = voting_records(config, config.clusters, public, embedded)
    source = ClusterVoteSource(records.shares, records.embed, config.clusters.votes_per_record,
                               num_cpus_per_actor=records.cpus_per_actor)
    if not config.secure:
        check_clean_votes_stay_home(source, "their records' vote histogram")
    return source
