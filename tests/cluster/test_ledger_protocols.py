"""Every ledger-like type is the protocol it is used as: NearPrivate's two ledgers as one are a
``ChargeGate``, each member with the protocol's arguments."""
from __future__ import annotations

import inspect

from conclave.cluster.active_learning import BothLedgers
from conclave.privacy.accounting.filter import RenyiFilter
from conclave.privacy.accounting.ledger import ChargeGate, PrivacyLedger


def has_members_of(value: object, protocol: type) -> bool:
    """``value`` is an instance of ``protocol`` and each of its methods takes the protocol's arguments."""
    for name, declared in vars(protocol).items():
        if inspect.isfunction(declared) and not name.startswith("_"):
            wanted = list(inspect.signature(declared).parameters)[1:]
            if list(inspect.signature(getattr(value, name)).parameters)[:len(wanted)] != wanted:
                return False
    return isinstance(value, protocol)


def test_near_privates_two_ledgers_are_a_charge_gate(tmp_path):
    run = PrivacyLedger(tmp_path / "run.sqlite", 1e-5, RenyiFilter(1.0, 1e-5, 32.0))
    model = PrivacyLedger(tmp_path / "model.sqlite", 1e-5, RenyiFilter(1.0, 1e-5, 32.0))
    try:
        assert has_members_of(BothLedgers(run, model), ChargeGate)
        assert has_members_of(run, ChargeGate)
    finally:
        run.close()
        model.close()
