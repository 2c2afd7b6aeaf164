"""One ``Ledger`` protocol: the run's ledger and an owner's lifetime ledger have every member of it,
with its arguments, and behave alike — a charge past the budget raises ``BudgetExceeded``, records
nothing and leaves its line in ``last_refusal``."""
from __future__ import annotations

import inspect

import pytest

from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter
from conclave.privacy.accounting.ledger import AnsweringLedger, BudgetExceeded, Ledger, PrivacyLedger
from conclave.privacy.accounting.owner_policy import OwnerBudget
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS
from tests.owner_ledgers import opened

DELTA = 1e-5


def gaussian(sigma: float) -> PrivacyCharge:
    return PrivacyCharge(DEFAULT_ORDERS, DEFAULT_ORDERS / (2 * sigma**2), label="gnmax")


def members(protocol: type) -> dict[str, object]:
    """The protocol's members (its own and its base protocols'): name → what it declares."""
    found: dict[str, object] = {}
    for cls in reversed([c for c in protocol.__mro__ if c in (Ledger, AnsweringLedger)]):
        found.update(dict.fromkeys(cls.__dict__.get("__annotations__", {})))
        found.update({name: value for name, value in vars(cls).items() if not name.startswith("_")})
    return found


def ledgers(tmp_path):
    run = PrivacyLedger(tmp_path / "run.sqlite", DELTA, RenyiFilter(1.0, DELTA, 32.0))
    owner = opened("hospital_a", OwnerBudget(epsilon=1.0, delta=DELTA, order=32.0, directory=str(tmp_path / "node_a")),
                   gaussian(10.0), "run-1")
    return {"run": run, "owner": owner}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CONCLAVE_HOME", str(tmp_path / "home"))


def test_every_ledger_has_every_member_of_the_protocol_with_its_arguments(tmp_path):
    opened = ledgers(tmp_path)
    try:
        for kind, ledger in opened.items():
            protocol = AnsweringLedger if kind != "owner" else Ledger
            assert isinstance(ledger, protocol), kind
            for name, declared in members(protocol).items():
                assert hasattr(ledger, name), (kind, name)
                if inspect.isfunction(declared):
                    arguments = list(inspect.signature(declared).parameters)[1:]
                    assert list(inspect.signature(getattr(ledger, name)).parameters)[:len(arguments)] == arguments
    finally:
        for ledger in opened.values():
            ledger.close()


def test_every_ledger_refuses_past_its_budget_alike(tmp_path):
    opened = ledgers(tmp_path)
    try:
        for kind, ledger in opened.items():
            ledger.charge(gaussian(10.0))
            assert ledger.can_afford(gaussian(10.0)) and ledger.refusal(gaussian(0.5)) is not None
            with pytest.raises(BudgetExceeded) as refused:
                ledger.charge(gaussian(0.5))
            assert ledger.last_refusal == str(refused.value) and "\n" not in ledger.last_refusal, kind
            assert ledger.report().charges == 1 and ledger.spent().rdp.tolist() == gaussian(10.0).rdp.tolist(), kind
    finally:
        for ledger in opened.values():
            ledger.close()
