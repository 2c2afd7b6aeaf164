"""Rounds: a run whose vote embedding is an earlier run's student (``network:PATH``) publishes the
composition of its own bound with every earlier round's, because its embedding (and what it asks)
came from their releases. The bounds travel inside the student checkpoint (``lineage``), so no
results folder need be found again, and each round hands on the whole chain."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from conclave.cluster.teaching.config import TeacherStudentConfig
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.composition import PublishedRun, composed_guarantee
from conclave.privacy.accounting.guarantee import run_worst_case

if TYPE_CHECKING:
    from conclave.cluster.run_privacy import RunPrivacy
    from conclave.learning.embeddings import NetworkEmbedding

NETWORK = "network:"


def this_round(config: TeacherStudentConfig, charged: PrivacyCharge | None = None) -> PublishedRun:
    """This run's bound: its planned worst case — or, where its ledger's charges at their worst
    cases (``charged``) went past it, theirs (``run_worst_case``) — under its declared budget."""
    planned = config.planned()
    return PublishedRun(config.name, run_worst_case(planned, charged), config.privacy.budget_filter(planned))


def earlier_rounds(config: TeacherStudentConfig) -> tuple[PublishedRun, ...]:
    """The runs behind this run's embedding, oldest first (none unless it embeds with a network)."""
    from conclave.learning.embeddings import NetworkEmbedding

    section = config.records_vote
    if section is None or not section.embedding.startswith(NETWORK):
        return ()
    network = NetworkEmbedding.load(section.embedding[len(NETWORK):])
    return tuple(PublishedRun.from_record(record) for record in network.lineage)


def with_earlier_rounds(privacy: RunPrivacy, config: TeacherStudentConfig, earlier: tuple[PublishedRun, ...],
                        charged: PrivacyCharge | None = None) -> RunPrivacy:
    """``privacy`` with the composition of this run (``this_round``) and ``earlier`` as its
    guarantee (its own beside it); unchanged without earlier rounds."""
    if not earlier:
        return privacy
    own = privacy.guarantee
    composed = composed_guarantee([*earlier, this_round(config, charged)], own.delta).marked(own.unsound_reasons)
    return dataclasses.replace(privacy, guarantee=composed).adding(
        rounds={"composed_with": [run.name for run in earlier], "this_run": own.as_dict()})


def with_lineage(network: NetworkEmbedding, config: TeacherStudentConfig, earlier: tuple[PublishedRun, ...],
                 charged: PrivacyCharge | None = None) -> NetworkEmbedding:
    """The student network carrying the bounds of every round behind it, this one's last."""
    return dataclasses.replace(network, lineage=tuple(run.as_record() for run in (*earlier, this_round(config, charged))))
