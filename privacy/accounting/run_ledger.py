"""A run's ledger with its owners' lifetime ledgers behind it.

The run's ledger (``PrivacyLedger``) is the run's view: its own budget, its answers, its
report. Owners that declare a lifetime budget keep their own ledgers on their nodes
(``privacy.accounting.owner_ledger``); a ``RunLedger`` checks a charge against the run's
budget and every owner's, and records it in all of them — owners first, the run's last, so a
release the run's ledger records is always on every owner's — before the caller releases
anything. Where the run's ledger then fails (a full disk, an unwritable record), the owners have
paid for a release that will not happen: ``OwnersChargedOnly`` says so, never "nothing was charged". It is an ``AnsweringLedger`` (``privacy.accounting.ledger``), so it stands wherever
the run's ledger does (the aggregator, DP-SGD, NearPrivate); the answers stay in the run's.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from conclave.errors import ConclaveError
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter
from conclave.privacy.accounting.ledger import AnsweringLedger, BudgetExceeded, BudgetReport
from conclave.privacy.accounting.ledger_identity import DriverRecords, LedgerIdentity
from conclave.privacy.accounting.owner_policy import OwnerTerms

log = logging.getLogger(__name__)


@runtime_checkable
class LifetimeLedgers(Protocol):
    """The owners' ledgers of a run, wherever they live (``actors.owner_ledger.OwnerLedgers``)."""

    def refusal(self, charge: PrivacyCharge) -> str | None: ...

    def charge(self, charge: PrivacyCharge, worst_case: PrivacyCharge | None = None) -> None: ...

    def reports(self) -> dict[str, BudgetReport]: ...

    def identities(self) -> list[LedgerIdentity]: ...

    @property
    def nodes(self) -> dict[str, str]: ...  # owner → the node its ledger lives on

    @property
    def terms(self) -> dict[str, OwnerTerms]: ...  # owner → its terms for the run, as its node decided them

    def close(self) -> None: ...


class OwnersChargedOnly(ConclaveError, RuntimeError):
    """The owners' ledgers recorded a charge the run's ledger then failed to record: nothing is
    released for it, and the owners paid for it all the same (more spent, never less)."""


class RunLedger:
    """The run's ``ledger`` and the ``owners``' lifetime ledgers, charged together."""

    def __init__(self, ledger: AnsweringLedger, owners: LifetimeLedgers, records: DriverRecords) -> None:
        self.ledger, self.owners, self.records = ledger, owners, records
        self.at_start = {r.owner: r for r in owners.identities()}
        records.note(list(self.at_start.values()))
        self.last_refusal: str | None = None  # the latest refusal's line: who stopped the run, if it stopped

    @property
    def path(self) -> Path:
        return self.ledger.path

    @property
    def delta(self) -> float:
        return self.ledger.delta

    @property
    def budget(self) -> RenyiFilter | None:
        return self.ledger.budget

    @property
    def neighbouring(self) -> Neighbouring:
        return self.ledger.neighbouring

    @property
    def orders(self) -> np.ndarray:
        return self.ledger.orders

    def refusal(self, charge: PrivacyCharge) -> str | None:
        """Why ``charge`` would be refused now (one line), or None."""
        refused = self.ledger.refusal(charge) or self.owners.refusal(charge)
        if refused is not None:
            self.last_refusal = refused
        return refused

    def can_afford(self, charge: PrivacyCharge) -> bool:
        return self.refusal(charge) is None

    def charge(self, charge: PrivacyCharge, worst_case: PrivacyCharge | None = None,
               answers: dict[bytes, int] | None = None) -> BudgetReport:
        """Record ``charge`` in every owner's ledger, then the run's, or raise ``BudgetExceeded``
        naming who refused. Everyone's budget is checked first, so a release one refuses costs
        no one anything (two runs charging one owner at once can still over-charge the others:
        more than was released, never less)."""
        refused = self.refusal(worst_case if worst_case is not None else charge)
        if refused is not None:  # checked first, so that no owner pays for what another refuses
            raise BudgetExceeded(refused)
        try:
            self.owners.charge(charge, worst_case)
        except BudgetExceeded as refusal:  # another run charged an owner since the check
            self.last_refusal = str(refusal)
            raise
        try:
            return self.ledger.charge(charge, worst_case=worst_case, answers=answers)
        except Exception as err:
            raise OwnersChargedOnly(f"the run's ledger could not record a charge its owners' ledgers had recorded "
                                    f"({str(err).splitlines()[0] if str(err) else type(err).__name__}): nothing was "
                                    "released for it; the owners paid for it") from err

    def report(self) -> BudgetReport:
        return self.ledger.report()

    def owner_reports(self) -> dict[str, BudgetReport]:
        return self.owners.reports()

    def record_answers(self, answers: dict[bytes, int]) -> None:
        self.ledger.record_answers(answers)

    def answers(self) -> dict[bytes, int]:
        return self.ledger.answers()

    def spent(self) -> PrivacyCharge:
        return self.ledger.spent()

    def worst_case_spent(self) -> PrivacyCharge:
        return self.ledger.worst_case_spent()

    def close(self) -> None:
        """Close the run's ledger and the owners' (the driver keeps a record of theirs)."""
        try:
            self.records.note(self.owners.identities())
        except Exception as err:  # noqa: BLE001 - an owner's node gone: its ledger is on its disk regardless
            log.warning("the driver's record of the owners' ledgers was not updated: %s", type(err).__name__)
        finally:
            self.owners.close()
            self.ledger.close()

    def __enter__(self) -> RunLedger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
