"""Public-cluster votes in place of teachers (the ``clusters`` section): the owners' records vote,
with their labels, for their m nearest medoids of the public pool's clusters, held by actors on the
owners' nodes (``actors.cluster_votes``)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from conclave.cluster.owners import PublicData, owner_data
from conclave.cluster.teaching.config import TeacherStudentConfig
from conclave.cluster.teaching.knn import check_clean_votes_stay_home

if TYPE_CHECKING:  # imported where used: loading a config needs neither torch nor Ray
    from conclave.actors.cluster_votes import ClusterVoteSource


def cluster_vote_source(config: TeacherStudentConfig, public: PublicData, embedded: bool = True) -> ClusterVoteSource:
    """The owners' cluster-vote actors, each holding its owner's records embedded on its node (Ray
    must be running). The embedding is fitted here on the public pool only (free); the records are
    read and embedded by the actors."""
    import ray

    from conclave.actors.cluster_votes import ClusterVoteSource
    from conclave.actors.owners import OwnerSource
    from conclave.actors.placement import cpu_share
    from conclave.actors.teacher import TeacherSource
    from conclave.actors.vote_parties import RecordShare
    from conclave.learning.embeddings import fit_embedding

    clusters = config.clusters
    embed = fit_embedding(clusters.embedding, public.splits.public.x, clusters.dims)
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    if config.owners:
        here = os.getcwd()  # a relative path is the launching directory's, as for teachers
        shares = [RecordShare(OwnerSource(owner.name, owner_data(owner, public.schema.columns, here), owner.teachers,
                                          public.classes, config.seed), owner.actors, owner.placement(embedded),
                              declared=owner.records)
                  for owner in config.owners]
    else:  # the benchmark's private split, cut into one part per actor (each record in exactly one)
        actors = clusters.actors or max(1, int(cpus / 2))
        source = TeacherSource(config.data.name, config.data.root, public_size=config.data.public_size,
                               num_teachers=actors, seed=config.seed, private_size=config.data.private_size)
        shares = [RecordShare(source, actors, declared=config.data.private_size)]
    total_actors = sum(min(share.num_actors, share.source.num_teachers) for share in shares)
    source = ClusterVoteSource(shares, embed, clusters.votes_per_record,
                               num_cpus_per_actor=max(cpus / 2, 0.01) / total_actors)
    if not config.secure:
        check_clean_votes_stay_home(source, "their records' vote histogram")
    return source
