"""An owner's lifetime ledger: runs compose in it, its budget refuses what would pass it (one
line naming the owner and what is left), and what it records about the data stays on the owner's
machine."""
from __future__ import annotations

import math
import stat

import numpy as np
import pytest

from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter, rdp_budget
from conclave.privacy.accounting.ledger import BudgetExceeded, read_ledger
from conclave.privacy.accounting.owner_ledger import OwnerLedger
from conclave.privacy.accounting.owner_policy import OwnerBudget, OwnerRefused
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS
from tests.owner_ledgers import opened


def gaussian(sigma: float, label: str = "gnmax") -> PrivacyCharge:
    """The RDP curve of one Gaussian release with L2 sensitivity 1: λ / (2σ²) (closed form)."""
    return PrivacyCharge(DEFAULT_ORDERS, DEFAULT_ORDERS / (2 * sigma**2), label=label)


def refused(ledger: OwnerLedger, charge: PrivacyCharge) -> str | None:
    """The owner's refusal of ``charge`` in one line, or None once it is recorded."""
    try:
        ledger.charge(charge)
    except BudgetExceeded as refusal:
        return str(refusal)
    return None


@pytest.fixture
def budget(tmp_path) -> OwnerBudget:
    return OwnerBudget(epsilon=2.0, delta=1e-5, directory=str(tmp_path / "node_a"))


def run(budget: OwnerBudget, name: str, charges: list[PrivacyCharge], data: tuple[str, ...] = ()) -> OwnerLedger:
    ledger = opened("hospital_a", budget, gaussian(10.0) if not charges else charges[0], name, data)
    for charge in charges:
        ledger.charge(charge)
    return ledger


def test_runs_compose_in_the_owners_ledger_and_its_order_stays_the_one_fixed_at_creation(budget):
    first = run(budget, "run-1", [gaussian(10.0)] * 3)
    order = first.report().budget.order
    first.close()
    second = run(budget, "run-2", [gaussian(5.0, "dpsgd")])  # another workload: the order does not move
    report = second.report()
    second.close()
    assert report.charges == 4 and report.budget.order == order
    expected = 3 * order / (2 * 10.0**2) + order / (2 * 5.0**2)  # Σ RDP at the filter's order
    assert report.rdp_at_budget_order == pytest.approx(expected, rel=1e-12)
    snapshot = read_ledger(budget.ledger_path("hospital_a"))
    assert snapshot.charges == 4


def test_a_charge_past_the_lifetime_budget_is_refused_in_one_line_naming_the_owner(budget):
    ledger = run(budget, "run-1", [])
    heavy = gaussian(6.0)
    refusals = [refused(ledger, heavy) for _ in range(40)]
    accepted = refusals.index(next(r for r in refusals if r is not None))
    assert ledger.refusal(heavy) == refusals[-1] and ledger.refusal(gaussian(1e6)) is None
    report = ledger.report()
    ledger.close()
    assert 0 < accepted < 40 and report.charges == accepted  # a refusal records nothing
    order = report.budget.order
    assert accepted == math.floor(rdp_budget(2.0, 1e-5, order) / (order / 72))  # the filter's closed form
    line = refusals[-1]
    assert "\n" not in line and line.startswith("owner hospital_a's lifetime budget ε 2 at δ 1e-05 refuses")
    assert f"order {order:g}" in line


def test_a_config_cannot_raise_a_budget_once_spent_on_but_may_ask_for_less(budget, tmp_path):
    run(budget, "run-1", [gaussian(10.0)]).close()
    richer = OwnerBudget(epsilon=20.0, delta=1e-5, directory=budget.directory)
    with pytest.raises(OwnerRefused, match="lifetime budget cannot change once spent on, but by its owner"):
        opened("hospital_a", richer, gaussian(10.0), "run-2")
    other_relation = OwnerBudget(epsilon=2.0, neighbouring=Neighbouring.REPLACE_ONE, directory=budget.directory)
    with pytest.raises(OwnerRefused, match="budget is for replace-one neighbours"):
        opened("hospital_a", other_relation, gaussian(10.0), "run-2")
    # ε 1 of the ledger's ε 2: this run stops where the lifetime spend would pass ε 1
    humble = opened("hospital_a", OwnerBudget(epsilon=1.0, delta=1e-5, directory=budget.directory), gaussian(10.0),
                    "run-2")
    refusals = [refused(humble, gaussian(6.0)) for _ in range(40)]
    order = humble.report().budget.order
    paid = humble.report().charges
    humble.close()
    assert paid - 1 == math.floor((rdp_budget(1.0, 1e-5, order) - order / 200) / (order / 72))
    assert refusals[-1].startswith("owner hospital_a's lifetime budget, kept within ε 1 of its ε 2 as this run asks")


def test_the_fingerprint_goes_with_each_charge_and_its_key_stays_private_on_the_node(budget, tmp_path):
    data = tmp_path / "records.csv"
    data.write_text("age,diagnosis\n50,1\n")
    ledger = run(budget, "run-1", [gaussian(10.0)], (str(data),))
    ledger.close()
    key = budget.ledger_path("hospital_a").with_name("hospital_a.key")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    snapshot = read_ledger(budget.ledger_path("hospital_a"))
    assert snapshot.charges == 1
    data.write_text("age,diagnosis\n50,1\n51,0\n")  # one more record: another fingerprint, the same budget
    again = run(budget, "run-2", [gaussian(10.0)], (str(data),))
    report = again.report()
    again.close()
    assert report.charges == 2


def test_owner_budgets_check_their_values():
    with pytest.raises(ValueError, match="budget.epsilon"):
        OwnerBudget(epsilon=math.inf)
    with pytest.raises(ValueError, match="reserved_delta"):
        OwnerBudget(epsilon=1.0, delta=1e-5, reserved_delta=1e-5)
    with pytest.raises(ValueError, match="neighbouring"):
        OwnerBudget(epsilon=1.0, neighbouring="swap")
    fixed = OwnerBudget(epsilon=2.0, order=16.0)
    assert fixed.filter(gaussian(10.0)) == RenyiFilter(2.0, 1e-5, 16.0)
    with pytest.raises(ValueError, match="no RDP budget at order 8"):
        OwnerBudget(epsilon=1.0, order=8.0)
    assert np.isclose(OwnerBudget(epsilon=1.0).filter(gaussian(10.0)).rdp_budget,
                      rdp_budget(1.0, 1e-5, OwnerBudget(epsilon=1.0).filter(gaussian(10.0)).order))
