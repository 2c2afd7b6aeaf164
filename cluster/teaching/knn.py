"""kNN votes in place of teachers (the ``knn`` section): the owners' records vote through their
nearest neighbours, held by actors on the owners' nodes (``actors.knn_votes``)."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from conclave.cluster.owners import PublicData, owner_data
from conclave.cluster.teaching.config import TeacherStudentConfig

if TYPE_CHECKING:  # imported where used: loading a config needs neither torch nor Ray
    from conclave.actors.knn_votes import KnnVoteSource

log = logging.getLogger(__name__)


def knn_vote_source(config: TeacherStudentConfig, public: PublicData, embedded: bool = True) -> KnnVoteSource:
    """The owners' kNN shard actors, each holding its owner's records embedded on its node (Ray
    must be running). The embedding is fitted here on the public pool only (free); the records
    are read and embedded by the actors."""
    import ray

    from conclave.actors.knn_votes import KnnVoteSource
    from conclave.actors.owners import OwnerSource
    from conclave.actors.placement import cpu_share
    from conclave.actors.teacher import TeacherSource
    from conclave.actors.vote_parties import RecordShare
    from conclave.learning.embeddings import fit_embedding

    knn = config.knn
    embed = fit_embedding(knn.embedding, public.splits.public.x, knn.dims)
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    if config.owners:
        here = os.getcwd()  # a relative path is the launching directory's, as for teachers
        shares = [RecordShare(OwnerSource(owner.name, owner_data(owner, public.schema.columns, here), owner.teachers,
                                          public.classes, config.seed), owner.actors, owner.placement(embedded),
                              declared=owner.records)
                  for owner in config.owners]
    else:  # the benchmark's private split, cut into one part per actor (each record in exactly one)
        actors = knn.actors or max(1, int(cpus / 2))
        source = TeacherSource(config.data.name, config.data.root, public_size=config.data.public_size,
                               num_teachers=actors, seed=config.seed, private_size=config.data.private_size)
        shares = [RecordShare(source, actors)]
    total_actors = sum(min(share.num_actors, share.source.num_teachers) for share in shares)
    source = KnnVoteSource(shares, embed, knn.k, knn.sample_rate, noise=config.privacy.noise,
                           num_cpus_per_actor=cpu_share(cpus / 2, total_actors), local=config.secure)
    if not config.secure:
        check_clean_votes_stay_home(source, "their neighbours' distances")
    return source


def check_clean_votes_stay_home(source, what: str) -> None:
    """Clean votes (kNN distances, public clusters' histograms) go to the aggregator: refuse them
    (one line, the actors stopped) unless every record belongs to one owner whose actors run on
    this node, the aggregator's."""
    import ray

    from conclave.cluster.config import ConfigError

    here = ray.get_runtime_context().get_node_id()
    away = sorted(owner for owner, nodes in source.placement.items() if set(nodes) != {here})
    if len(source.placement) > 1 or away:
        source.shutdown()
        raise ConfigError(f"the votes of owner(s) {away or sorted(source.placement)} would send {what} off their "
                          "node to the aggregator: set aggregation: secure")
