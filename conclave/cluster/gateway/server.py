"""The gateway's gRPC server: the Owner service alone, over mutual TLS, on the owner's listen address.

Each call's bytes are parsed here into the declared message (undeclared fields refused, nothing
unpickled) and handed to the ``OwnerServicer``; a refusal becomes its status code with its one
line. A client must present a certificate the consortium CA issued (``require_client_auth``): a
handshake without one fails before any call. ``start_gateway`` is what ``conclave owner serve``
and the tests start: it refuses an owner with no policy on this machine.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from google.protobuf.message import Message

from conclave.cluster.gateway.declaration import Declaration
from conclave.cluster.gateway.identity import Identity, Verifier
from conclave.cluster.gateway.servicer import OwnerServicer
from conclave.cluster.gateway.wire import Refused, parse
from conclave.cluster.tls import check_server_files
from conclave.privacy.accounting.owner_policy import OwnerBudget, OwnerPolicy, OwnerRefused
from conclave.protos import owner_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = owner_pb2.DESCRIPTOR.services_by_name["Owner"].full_name  # "conclave.owner.Owner"
MAX_MESSAGE = 64 * 1024 * 1024  # a public pool of ~250,000 digit-sized inputs


def owner_policy(owner: str) -> OwnerPolicy:
    """The owner's policy on this machine; a gateway never serves without one."""
    policy = OwnerPolicy.load(owner)
    if policy is None:
        raise OwnerRefused(f"owner {owner} has no policy on this machine: write one with "
                           f"`conclave owner init {owner} --epsilon E`")
    return policy


class GatewayServer:
    """The Owner service of ``servicer`` on ``declaration.listen`` (port 0: any free one)."""

    def __init__(self, servicer: OwnerServicer, declaration: Declaration, workers: int = 8) -> None:
        self.servicer, self.declaration = servicer, declaration
        self._server = grpc.server(ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gateway"), options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.so_reuseport", 0),  # a second server on this port fails to bind, never shares it
        ])
        calls = {"Describe": (servicer.describe, owner_pb2.DescribeRequest),
                 "Admit": (servicer.admit, owner_pb2.AdmitRequest),
                 "Keys": (servicer.keys, owner_pb2.KeysRequest),
                 "Votes": (servicer.votes, owner_pb2.VotesRequest),
                 "Step": (servicer.step, owner_pb2.StepRequest),
                 "NearPrivate": (servicer.near_private, owner_pb2.NearPrivateRequest),
                 "Budget": (servicer.budget, owner_pb2.BudgetRequest)}
        self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE_NAME, {
            name: grpc.unary_unary_rpc_method_handler(_handled(name, call, kind),
                                                      response_serializer=_serialized)
            for name, (call, kind) in calls.items()})])
        self.address: str | None = None

    def start(self) -> str:
        """Serve; returns ``host:port`` as bound."""
        tls = self.declaration.tls
        check_server_files(Path(tls.certificate), Path(tls.key), Path(tls.ca))
        credentials = grpc.ssl_server_credentials(
            [(Path(tls.key).read_bytes(), Path(tls.certificate).read_bytes())],
            root_certificates=Path(tls.ca).read_bytes(), require_client_auth=True)
        host, port = self.declaration.host_port
        try:
            bound = self._server.add_secure_port(f"{host}:{port}", credentials)
        except RuntimeError:
            raise OSError(f"could not bind the gateway to {host}:{port}: in use or not on this host") from None
        self._server.start()
        self.address = f"{host}:{bound}"
        return self.address

    def stop(self, grace: float = 1.0) -> None:
        """Stop answering (calls in flight get ``grace`` seconds), then the run's actors and ledger."""
        self._server.stop(grace).wait()
        self.servicer.stop()


def start_gateway(declaration: Declaration, cpus_per_actor: float = 1.0,
                  asked: OwnerBudget | None = None) -> GatewayServer:
    """The owner's gateway serving (Ray must be running: the owner's own). ``asked``: the budget a run
    that starts the gateway itself on the owner's machine declares for it (``cluster.gateway.local``),
    which stands where the owner wrote no policy; without it, a policy is required."""
    policy = owner_policy(declaration.name) if asked is None else OwnerPolicy.load(declaration.name)
    tls = declaration.tls
    servicer = OwnerServicer(declaration, policy, Identity(Path(tls.certificate), Path(tls.key)),
                             Verifier(Path(tls.ca)), cpus_per_actor, asked)
    server = GatewayServer(servicer, declaration)
    server.start()
    log.info("owner %s: gateway serving on %s", declaration.name, server.address)
    return server


def _serialized(message: Message) -> bytes:
    return message.SerializeToString()


def _handled(name: str, call: Callable[[Message], Message], kind: type[Message]):
    def handle(raw: bytes, context: grpc.ServicerContext) -> Message:
        try:
            return call(parse(kind, raw))
        except Refused as err:
            log.info("%s refused (%s): %s", name, err.code.name, err)
            context.abort(err.code, str(err))
        except Exception as err:  # noqa: BLE001 - a failure's details stay on the owner's machine
            log.warning("%s failed: %s", name, type(err).__name__, exc_info=True)
            context.abort(grpc.StatusCode.INTERNAL, f"the gateway failed ({type(err).__name__}); its owner has the "
                                                    "details")
    return handle
