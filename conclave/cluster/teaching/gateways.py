"""Owners reached through their gateways (``owners: [{name, gateway: HOST:PORT}]`` with
``gateways:``, or the gateways a run starts on this machine for owners named by their data,
``cluster.gateway.local``): the run's vote source is a ``GatewayVoteSource`` that admits the run at every
owner's gateway with the config's terms. The owners' records, actors and ledgers stay behind their
gateways, on their machines; the coordinator sends only public data (the pool, how it is read) and
typed terms, and its run ledger is its view of what each owner's ledger charged first.
"""
from __future__ import annotations

import math
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from conclave.cluster.owners import PublicData
from conclave.cluster.teaching.config import TeacherStudentConfig

if TYPE_CHECKING:  # imported where used: loading a config needs neither gRPC nor Ray
    from conclave.cluster.gateway.client import GatewayVoteSource


def gateway_vote_source(config: TeacherStudentConfig, public: PublicData) -> GatewayVoteSource:
    """Every owner's gateway admitting this run: its vote source and terms, the mechanism and its
    σ, the plan's worst case (the student's batches and rounds), the public pool the embedding is
    fitted on and how the owner's data are read, and ``gateways.lifetime_epsilon`` if given."""
    from conclave.cluster.gateway.client import CoordinatorTls, GatewayVoteSource, OwnerGateway
    from conclave.cluster.gateway.identity import Verifier
    from conclave.learning.embeddings import fit_embedding

    files = config.gateways
    tls = CoordinatorTls(Path(files.certificate), Path(files.key), Path(files.ca))
    source = config.vote_source
    terms, sigma, sends_pool = source.gateway_terms(config)
    pool = public.splits.public.x if sends_pool else None
    student = config.student
    # Confident-GNMax's batches are two rounds each (the threshold, then the answer)
    rounds = math.ceil(student.queries / student.batch_size) * (2 if config.mechanism.name == "confident-gnmax" else 1)
    gateways = [OwnerGateway(owner.gateway, tls) for owner in config.owners]
    # the student picks what to ask in the same embedding, fitted here on the pool alone (free)
    embed = fit_embedding(source.section.embedding, pool, source.section.dims) if source.asks_in_embedding else None
    return GatewayVoteSource(gateways, Verifier(tls.ca), f"{config.name}-{secrets.token_hex(4)}", terms,
                             config.mechanism.name, sigma, public.classes, pool,
                             max_batch=student.batch_size, rounds=rounds,
                             lifetime_epsilon=files.lifetime_epsilon, reading=public.reading, embed=embed,
                             names=[owner.name for owner in config.owners],
                             input_shape=public.splits.public.x.shape[1:])
