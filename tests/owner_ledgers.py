"""An owner's lifetime ledger opened as the owner's node opens it for a run: admitted by its
policy on this node (else the config's budget), then opened for the run."""
from __future__ import annotations

from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.owner_ledger import OwnerLedger
from conclave.privacy.accounting.owner_policy import OwnerAdmission, OwnerBudget, OwnerRefused, RunRequest


def opened(owner: str, asked: OwnerBudget | None, planned: PrivacyCharge, run: str,
           data: tuple[str, ...] = ()) -> OwnerLedger:
    """``owner``'s ledger, open for ``run`` (whose worst case is ``planned``), or ``OwnerRefused``."""
    terms = OwnerAdmission(owner, asked, data).admit(RunRequest(run), planned)
    if terms is None:
        raise OwnerRefused(f"owner {owner}: no lifetime budget (no policy on its node, none in the config)")
    return OwnerLedger.open(terms, planned, run, data)
