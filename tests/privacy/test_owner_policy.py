"""An owner's policy on its node decides its budget: a run's config may ask for less, never more,
and cannot move the ledger; the policy admits pipelines and mechanisms and caps a run's planned
worst case; data it guards cannot be named as another owner's; and only the owner changes the
budget, as an entry of its ledger (a hand-edited policy is refused)."""
from __future__ import annotations

import json

import pytest

from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.ledger import BudgetExceeded, LedgerInUse, read_ledger
from conclave.privacy.accounting.owner_ledger import OwnerLedger
from conclave.privacy.accounting.owner_policy import (
    OwnerAdmission, OwnerBudget, OwnerPolicy, OwnerRefused, RunRequest, budget_statement, change_budget, write_policy,
)
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS
from tests.owner_ledgers import opened

REQUEST = RunRequest("hospitals-3", "teacher_student", ("gnmax",))


def gaussian(sigma: float, label: str = "gnmax") -> PrivacyCharge:
    return PrivacyCharge(DEFAULT_ORDERS, DEFAULT_ORDERS / (2 * sigma**2), label=label)


def refused(ledger: OwnerLedger, charge: PrivacyCharge) -> str | None:
    """The owner's refusal of ``charge`` in one line, or None once it is recorded."""
    try:
        ledger.charge(charge)
    except BudgetExceeded as refusal:
        return str(refusal)
    return None


@pytest.fixture
def node(tmp_path, monkeypatch):
    """The owner's node: its own Conclave folder, its data, and hospital_a's policy (ε 2)."""
    monkeypatch.setenv("CONCLAVE_HOME", str(tmp_path / "home"))
    data = tmp_path / "data" / "a"
    data.mkdir(parents=True)
    (data / "records.csv").write_text("age,diagnosis\n50,1\n")
    write_policy(OwnerPolicy("hospital_a", 2.0, str(tmp_path / "ledgers"), data=(str(data),)))
    return tmp_path


def admitted(asked: OwnerBudget | None, request: RunRequest = REQUEST, planned=None, owner="hospital_a",
             data: tuple[str, ...] = ()):
    return OwnerAdmission(owner, asked, data).admit(request, planned or gaussian(10.0))


def test_the_policy_decides_and_a_config_may_ask_for_less_never_more_nor_elsewhere(node):
    terms = admitted(None)  # the config declares no budget: the policy's is in force all the same
    assert (terms.source, terms.budget.epsilon, terms.cap) == ("policy", 2.0, None)
    assert terms.budget.directory == str(node / "ledgers")
    assert admitted(OwnerBudget(1.5)).cap == 1.5
    assert admitted(OwnerBudget(2.0, directory=str(node / "ledgers"))).cap is None
    with pytest.raises(OwnerRefused, match=r"^owner hospital_a: the config asks for a lifetime budget of ε 20, more "
                                           r"than the ε 2 its policy allows; a run may ask for less, never more$"):
        admitted(OwnerBudget(20.0))
    with pytest.raises(OwnerRefused, match="the config names its ledger folder .*fresh.*; a run cannot move"):
        admitted(OwnerBudget(1.0, directory=str(node / "fresh")))
    with pytest.raises(OwnerRefused, match="declares another budget"):
        admitted(OwnerBudget(1.0, delta=1e-6))
    # an owner with no policy keeps the config's budget, said so
    terms = admitted(OwnerBudget(5.0, directory=str(node / "b")), owner="hospital_b")
    assert terms.source == "config" and "whoever writes the config chooses it" in budget_statement(terms.source)
    assert admitted(None, owner="hospital_b") is None


def test_the_policy_admits_pipelines_and_mechanisms_and_caps_one_run(node):
    write_policy(OwnerPolicy("hospital_a", 2.0, str(node / "ledgers"), pipelines=("teacher_student",),
                             mechanisms=("gnmax", "confident-gnmax"), max_run_epsilon=1.0,
                             data=OwnerPolicy.load("hospital_a").data))
    assert admitted(None).source == "policy"
    with pytest.raises(OwnerRefused, match="admits the pipelines teacher_student .*; run 'x' is active_learning$"):
        admitted(None, RunRequest("x", "active_learning", ("dpsgd",)))
    with pytest.raises(OwnerRefused, match="run 'x' does not name its pipeline"):
        admitted(None, RunRequest("x"))
    with pytest.raises(OwnerRefused, match="admits the mechanisms gnmax, confident-gnmax .*releases through lnmax"):
        admitted(None, RunRequest("x", "teacher_student", ("lnmax",)))
    with pytest.raises(OwnerRefused, match=r"allows at most ε 1 per run .*; run 'hospitals-3' plans up to ε \d"):
        admitted(None, planned=gaussian(1.0))


def test_another_owners_data_cannot_be_named_under_a_new_name(node):
    data = node / "data" / "a"
    with pytest.raises(OwnerRefused, match=f"^owner fresh_name: its data {data / 'records.csv'} is hospital_a's"):
        admitted(OwnerBudget(50.0), owner="fresh_name", data=(str(data / "records.csv"),))
    with pytest.raises(OwnerRefused, match="is hospital_a's"):  # a folder holding it
        admitted(None, owner="fresh_name", data=(str(node / "data"),))
    assert admitted(None, data=(str(data / "records.csv"),)).source == "policy"  # its own: fine


def test_the_owner_raises_its_budget_in_its_ledger_and_a_hand_edited_policy_is_refused(node):
    ledger = opened("hospital_a", None, gaussian(10.0), "run-1")
    while refused(ledger, gaussian(4.0)) is None:
        pass
    spent = ledger.report().charges
    with pytest.raises(LedgerInUse):  # not while a run holds the ledger
        change_budget("hospital_a", 4.0)
    ledger.close()

    policy, entry = change_budget("hospital_a", 4.0)
    assert policy.epsilon == 4.0 and OwnerPolicy.load("hospital_a").epsilon == 4.0
    assert (entry.previous, entry.epsilon, entry.entry) == (2.0, 4.0, spent + 1)
    again = opened("hospital_a", None, gaussian(10.0), "run-2")
    again.charge(gaussian(4.0))  # the raised budget pays again
    report = again.report()
    again.close()
    assert report.guarantee.epsilon == 4.0 and [c.epsilon for c in report.changes] == [4.0]
    assert read_ledger(node / "ledgers" / "hospital_a.sqlite").entries == spent + 2

    edited = json.loads(OwnerPolicy.file("hospital_a").read_text())
    OwnerPolicy.file("hospital_a").write_text(json.dumps({**edited, "epsilon": 40.0}))  # not by the owner's command
    with pytest.raises(OwnerRefused, match="its policy says ε 40 but its ledger's budget is ε 4; a budget changes"):
        opened("hospital_a", None, gaussian(10.0), "run-3")
    with pytest.raises(OwnerRefused, match="already declares"):  # a policy's budget is rewritten only by raise/lower
        write_policy(OwnerPolicy("hospital_a", 8.0, str(node / "ledgers")))
