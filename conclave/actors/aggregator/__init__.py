"""The teacher aggregator as a gRPC service: the labelling core (``actors.labeller``) behind an
asyncio server that idle or hostile clients cannot starve. One module per job:

    server.py      AggregatorServer (labels in process; starts and stops the service), AggregatorActor
    service.py     the asyncio gRPC server: Label, LabelStream, GetBudget, health and reflection
    gatekeeper.py  the bearer token; caps and idle limits on every stream of every service
    health.py      whether the voters can vote: health turns NOT_SERVING on a failed vote until they can
    refusals.py    what a failure tells the client (a full disk, an unwritable ledger record)
    settings.py    ServerSettings: where it listens, who may call it, how much it takes on at once
"""
from conclave.actors.aggregator.refusals import RECORD_UNWRITABLE, STORAGE_FULL, storage_full
from conclave.actors.aggregator.server import AggregatorActor, AggregatorServer
from conclave.actors.aggregator.service import SERVICE_NAME
from conclave.actors.aggregator.settings import ServerSettings, is_loopback

__all__ = ["RECORD_UNWRITABLE", "SERVICE_NAME", "STORAGE_FULL", "AggregatorActor", "AggregatorServer",
           "ServerSettings", "is_loopback", "storage_full"]
