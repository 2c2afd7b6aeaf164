"""The owner's gateway: the Owner service over the owner's own Ray, its policy and its ledger.

A coordinator reaches the owner only through these calls (``protos/owner.proto``), each answered
here or handed to the job it belongs to: a vote run's (``cluster.gateway.vote_runs``) or a DP-SGD
run's (``cluster.gateway.dpsgd_runs``). ``Admit`` checks a run's terms against the owner's policy
(``OwnerAdmission.admit``: mechanisms, the per-run ceiling, the lifetime ε asked), as both kinds of run
are admitted (``cluster.gateway.runs``). Every refusal is one line with a gRPC status, and nothing is
charged. One run at a time: admitting a new run ends the previous one (its actors stop, its ledger closes).
"""
from __future__ import annotations

import threading

import grpc

from conclave.cluster.gateway.declaration import Declaration
from conclave.cluster.gateway.dpsgd_runs import DpsgdRuns
from conclave.cluster.gateway.identity import Identity, Verifier
from conclave.cluster.gateway.runs import OwnerRuns
from conclave.cluster.gateway.steps import AdmittedSteps
from conclave.cluster.gateway.vote_runs import VoteRuns
from conclave.cluster.gateway.wire import Refused
from conclave.privacy.accounting.ledger import LedgerDamaged, read_ledger
from conclave.privacy.accounting.owner_policy import OwnerBudget, OwnerPolicy, OwnerRefused
from conclave.privacy.accounting.rdp import epsilon_from_rdp
from conclave.protos import owner_pb2


class OwnerServicer:
    """The Owner service's calls for one owner (``declaration``), its policy on this machine, its
    signing ``identity`` and the consortium CA's ``verifier``. Ray must be running (the owner's).
    ``asked``: the budget a run that started this gateway itself declares for the owner (``OwnerRuns``)."""

    def __init__(self, declaration: Declaration, policy: OwnerPolicy | None, identity: Identity, verifier: Verifier,
                 cpus_per_actor: float = 1.0, asked: OwnerBudget | None = None) -> None:
        if policy is None and asked is None:
            raise OwnerRefused(f"owner {declaration.name} has no policy on this machine")
        self.declaration = declaration
        self._lock = threading.Lock()  # one call changes the state at a time
        self._runs = OwnerRuns(declaration, policy, asked)
        self._votes = VoteRuns(declaration, self._runs, identity, verifier, cpus_per_actor)
        self._steps = DpsgdRuns(declaration, self._runs, identity, verifier)

    @property
    def lifetime(self) -> OwnerBudget:
        """The lifetime budget in force: the policy's, else the one the run that started this gateway declares."""
        return self._runs.lifetime

    def describe(self, request: owner_pb2.DescribeRequest) -> owner_pb2.Description:
        declaration, policy, lifetime = self.declaration, self._runs.policy, self.lifetime
        mechanisms, ceiling = (policy.mechanisms, policy.max_run_epsilon) if policy is not None else ((), None)
        return owner_pb2.Description(owner=declaration.name, records=declaration.records,
                                     vote_sources=list(declaration.vote_sources), mechanisms=list(mechanisms),
                                     max_run_epsilon=ceiling or 0.0, epsilon=lifetime.epsilon, delta=lifetime.delta)

    def admit(self, request: owner_pb2.AdmitRequest) -> owner_pb2.AdmitReply:
        with self._lock:
            if request.WhichOneof("vote_source") == "dpsgd":
                return self._steps.admit(request)
            return self._votes.admit(request)

    def keys(self, request: owner_pb2.KeysRequest) -> owner_pb2.SignedKey:
        with self._lock:
            current = self._runs.current
            if isinstance(current, AdmittedSteps) and current.run == request.run:
                return self._steps.key(request)
            return self._votes.key(request)

    def votes(self, request: owner_pb2.VotesRequest) -> owner_pb2.VotesReply:
        with self._lock:
            return self._votes.votes(request)

    def step(self, request: owner_pb2.StepRequest) -> owner_pb2.StepReply:
        with self._lock:
            return self._steps.step(request)

    def near_private(self, request: owner_pb2.NearPrivateRequest) -> owner_pb2.StepReply:
        with self._lock:
            return self._steps.near_private(request)

    def budget(self, request: owner_pb2.BudgetRequest) -> owner_pb2.BudgetReply:
        owner, lifetime = self.declaration.name, self.lifetime
        reply = owner_pb2.BudgetReply(owner=owner, epsilon_limit=lifetime.epsilon, delta=lifetime.delta)
        path = lifetime.ledger_path(owner)
        if path.exists():
            try:
                snapshot = read_ledger(path)
            except LedgerDamaged as err:  # its owner's to repair; the line names the ledger and what is wrong
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(err).splitlines()[0]) from None
            spent = snapshot.spent
            reply.epsilon_spent = epsilon_from_rdp(spent.orders, spent.rdp, snapshot.delta)[0] if snapshot.charges else 0.0
            reply.charges = snapshot.charges
        return reply

    def stop(self) -> None:
        with self._lock:
            self._runs.stop()
