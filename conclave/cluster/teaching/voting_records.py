"""What the vote sources in which records vote themselves (the ``knn`` and ``clusters`` sections)
share: the public embedding, the benchmark's records cut into actor shares, the rule that clean votes
never leave the aggregator's node, and what behind the owners' gateways (where owners' records vote)
needs of them."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conclave.cluster.owners import PublicData
from conclave.cluster.teaching.config import ClustersConfig, KnnConfig, TeacherStudentConfig
from conclave.errors import InvalidValue

if TYPE_CHECKING:  # imported where used: loading a config needs neither torch nor Ray
    from conclave.actors.cluster_votes import ClusterVoteSource
    from conclave.actors.knn_votes import KnnVoteSource
    from conclave.actors.vote_parties import RecordShare
    from conclave.cluster.teaching.vote_source import VoteSource
    from conclave.learning.embeddings import Embedding


@dataclass(frozen=True)
class VotingRecords:
    """The embedding (fitted on the public pool only: free), the records' share of the vote actors
    (read and embedded by them), and the CPUs each actor reserves."""

    embed: Embedding
    shares: list[RecordShare]
    cpus_per_actor: float


def voting_records(config: TeacherStudentConfig, section: KnnConfig | ClustersConfig,
                   public: PublicData) -> VotingRecords:
    """The benchmark's private split cut into one part per actor (each record in exactly one) as the
    record share of ``section``'s vote actors; half the cluster's CPUs go to them (Ray must be
    running). Owners' records vote behind their gateways instead."""
    import ray

    from conclave.actors.placement import cpu_share
    from conclave.actors.teacher import TeacherSource
    from conclave.actors.vote_parties import RecordShare
    from conclave.learning.embeddings import fit_embedding

    if config.owners:
        raise InvalidValue("owners' records vote behind their gateways, not in the coordinator's cluster")
    embed = fit_embedding(section.embedding, public.splits.public.x, section.dims)
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    actors = section.actors or max(1, int(cpus / 2))
    source = TeacherSource(config.data.name, config.data.root, public_size=config.data.public_size,
                           num_teachers=actors, seed=config.seed, private_size=config.data.private_size)
    share = RecordShare(source, actors, declared=config.data.private_size)
    return VotingRecords(embed, [share], cpu_share(cpus / 2, min(share.num_actors, source.num_teachers)))


def check_clean_votes_stay_home(source: KnnVoteSource | ClusterVoteSource, what: str) -> None:
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


def check_gateway_embedding(source: VoteSource) -> None:
    """Records voting behind the owners' gateways are embedded there: in a registered embedding."""
    from conclave.learning.embeddings import EMBEDDINGS

    if source.section.embedding not in EMBEDDINGS:
        raise InvalidValue(f"{source.kind}.embedding {source.section.embedding!r}: a gateway fits only a registered "
                         f"embedding ({', '.join(EMBEDDINGS)})")


def records_described(source: VoteSource, pool: Any) -> dict[str, Any]:
    """What voted, for the run's metrics: the section, the actors, and where they ran."""
    return {source.kind: {**dataclasses.asdict(source.section), "actors": pool.num_actors, "nodes": pool.placement}}
