"""The owner's runs at its gateway, whatever they release: one at a time, none admitted twice.

What admitting any run shares: the owner's policy, read afresh at each admission (else the budget a
run that started the gateway declares for it), admits the run's whole planned charge; the owner's
ledger then opens for the run, able to pay its least release, before anything starts or trains; the
owner's data are read as the run reads them. Admitting a run ends the previous one (its actors stop,
its ledger closes). Every refusal is one line with a gRPC status, and nothing is charged.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import grpc

from conclave.cluster.gateway.declaration import Declaration
from conclave.cluster.gateway.wire import Refused
from conclave.learning.data.sources import DataSource, PublicReading
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.ledger import LedgerDamaged, LedgerInUse
from conclave.privacy.accounting.owner_ledger import OwnerLedger
from conclave.privacy.accounting.owner_policy import (OwnerAdmission, OwnerBudget, OwnerPolicy, OwnerRefused, OwnerTerms,
                                                      RunRequest)
from conclave.protos import owner_pb2

log = logging.getLogger(__name__)


class AdmittedRun(Protocol):
    """An admitted run of either kind (``vote_runs.AdmittedVotes``, ``steps.AdmittedSteps``)."""

    run: str

    def stop(self) -> None: ...


class OwnerRuns:
    """The admitted run of one owner (``declaration``), under its ``policy`` on this machine.

    ``asked``: the budget that a run which started this gateway itself, on the owner's machine
    (``cluster.gateway.local``), declares for the owner: the budget where no policy is written here
    (``policy`` None), else a request for less that the policy checks (never more, nor another ledger
    folder). None: the policy alone decides, and there must be one."""

    def __init__(self, declaration: Declaration, policy: OwnerPolicy | None, asked: OwnerBudget | None) -> None:
        self.declaration, self.policy, self._asked = declaration, policy, asked
        self.current: AdmittedRun | None = None
        self._seen: set[str] = set()
        self._data_paths = (declaration.data.path,) if declaration.data.path else ()  # fingerprinted with each charge

    @property
    def lifetime(self) -> OwnerBudget:
        """The lifetime budget in force: the policy's, else the one the run that started this gateway declares."""
        return self.policy.budget() if self.policy is not None else self._asked

    def check_unseen(self, run: str, releases: str) -> None:
        """Refused if ``run`` was admitted before: its ``releases`` (rounds, steps) are never replayed."""
        if run in self._seen:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"run '{run[:40]}' was admitted before: a run's {releases} are never replayed")

    def owner_data(self, reading: PublicReading) -> DataSource:
        """The owner's data as the run reads them (by the pool's columns, at its size): a string
        operation, no file opened; an owner's file that names other columns or another size is refused."""
        try:
            return self.declaration.data.read_as(reading)
        except ValueError as err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"owner {self.declaration.name}: {err}") from None

    def admitted_terms(self, request: owner_pb2.AdmitRequest, planned: PrivacyCharge, pipeline: str,
                       releases: tuple[str, ...] = ()) -> OwnerTerms:
        """The terms the owner's policy (else the budget ``asked`` at the start) admits the run under
        (refused otherwise); nothing is opened or charged. The policy is read again: the owner may have
        changed it (``conclave owner raise``) meanwhile."""
        owner = self.declaration.name
        try:
            policy = OwnerPolicy.load(owner)
        except OwnerRefused as err:  # unreadable
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, str(err)) from None
        if policy is None and self._asked is None:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"owner {owner} has no policy on its machine any more: "
                                                             "it admits no run")
        self.policy = policy
        lifetime = self.lifetime
        if planned.neighbouring != lifetime.neighbouring:  # as ``OwnerLedger.open`` refuses, before anything ends
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"owner {owner}: its budget is for {lifetime.neighbouring} neighbours; these releases' "
                          f"charges hold for {planned.neighbouring} neighbours of its records")
        asked = self._asked
        if request.lifetime_epsilon:  # the lifetime ε the run asks to stay within, checked as a budget asked
            asked = dataclasses.replace(asked if asked is not None else lifetime, epsilon=request.lifetime_epsilon)
        try:
            terms = OwnerAdmission(owner, asked, self._data_paths).admit(
                RunRequest(request.run, pipeline, (request.mechanism, *releases)), planned)
        except OwnerRefused as err:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, str(err)) from None
        return terms  # a policy or the budget asked is in force: terms, never None

    def end_current(self, admitting: str) -> None:
        """End the run in progress, if any, as run ``admitting`` is admitted."""
        if self.current is not None:
            log.info("run '%s' ends: run '%s' is admitted", self.current.run, admitting)
            self.stop()

    def open(self, terms: OwnerTerms, planned: PrivacyCharge, run: str, first: PrivacyCharge) -> OwnerLedger:
        """The run's ledger under the admitted ``terms``, open, once it can pay for ``first`` (the least
        the run releases: one round of one query, or a DP-SGD run's whole schedule) before anything starts
        or trains: refused otherwise, the ledger closed and nothing charged."""
        try:
            ledger = OwnerLedger.open(terms, planned, run, self._data_paths)
        except OwnerRefused as err:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, str(err)) from None
        except (LedgerInUse, LedgerDamaged) as err:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(err).splitlines()[0]) from None
        refused = ledger.refusal(first)
        if refused is not None:
            ledger.close()
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{refused}; nothing was admitted or charged")
        return ledger

    def admitted(self, run: AdmittedRun) -> None:
        """``run`` is the one in progress now; its name is never admitted again."""
        self.current = run
        self._seen.add(run.run)

    def stop(self) -> None:
        """End the run in progress, if any (its actors stop, its ledger closes)."""
        if self.current is not None:
            self.current.stop()
            self.current = None
