"""The durable ledger as a Rényi filter: refusals record nothing, the budget is enforced at its
one fixed order, reopening restores exactly (and refuses other settings), concurrent charges
never overshoot, δ is split between the RDP curve and the reserved δ, and charges for another
neighbouring relation are refused. And the ledger defends itself: one writer at a time, and a
file edited, truncated or older than its checksums is refused in one line."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.filter import RenyiFilter, choose_order, filter_for, rdp_budget
from conclave.privacy.accounting.ledger import (
    BudgetExceeded,
    LedgerDamaged,
    LedgerInUse,
    PrivacyLedger,
    read_ledger,
)
from conclave.privacy.accounting.ledger_format import settings_checksum
from conclave.privacy.accounting.rdp import (
    DEFAULT_ORDERS,
    approximate_dp_charge,
    epsilon_from_rdp,
    gaussian_charge,
    pure_epsilon_charge,
    sampled_gaussian_charge,
    unbounded_charge,
)

DELTA = 1e-5
ORDER = 32.0  # a grid order, fixed in advance by the tests that do not choose one


def budget(epsilon: float, order: float = ORDER, reserved: float = 0.0) -> RenyiFilter:
    return RenyiFilter(epsilon, DELTA, order, reserved_delta=reserved)


def rows(path) -> int:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT COUNT(*) FROM charges").fetchone()[0]


def fitting(unit_rdp_at_order: float, filter_: RenyiFilter) -> int:
    """How many units the filter admits, worked out on paper: the largest k with k·ρ ≤ B."""
    return int(math.floor(filter_.rdp_budget / unit_rdp_at_order * (1 + 1e-12)))


def test_durability_settings(tmp_path):
    path = tmp_path / "ledger.db"
    with PrivacyLedger(path, DELTA, budget(1.0)) as ledger:
        assert ledger._store._connection().execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_over_budget_refusal_records_nothing(tmp_path):
    path = tmp_path / "ledger.db"
    with PrivacyLedger(path, DELTA, budget(1.0)) as ledger:
        first = ledger.charge(gaussian_charge(10.0, count=2, label="small"))
        assert 0 < first.epsilon_spent < 1.0 and first.charges == 1
        assert not ledger.can_afford(gaussian_charge(1.0, label="big"))
        with pytest.raises(BudgetExceeded, match=r"'big' would bring RDP at order 32 to .* over the budget"):
            ledger.charge(gaussian_charge(1.0, label="big"))
        assert ledger.report() == first
        assert rows(path) == 1
    with PrivacyLedger(path, DELTA, budget(1.0)) as reopened:
        assert reopened.report() == first


def test_the_filter_refuses_at_its_order_where_another_order_would_allow(tmp_path):
    # A Gaussian workload converts best near order 15; a filter fixed (badly) at order 64
    # must refuse once RDP(64) passes its budget, though the minimum over orders is far lower.
    filter_ = budget(3.0, order=64.0)
    unit = gaussian_charge(10.0, label="gaussian")  # RDP(λ) = λ/200
    with PrivacyLedger(tmp_path / "ledger.db", DELTA, filter_) as ledger:
        accepted = 0
        while ledger.can_afford(unit):
            ledger.charge(unit)
            accepted += 1
        assert accepted == fitting(64 / 200, filter_) == 9
        spent = ledger.spent()
        allowed_elsewhere = epsilon_from_rdp(DEFAULT_ORDERS, spent.rdp + unit.rdp, DELTA)[0]
        assert allowed_elsewhere < 1.5  # another order would have let it through...
        with pytest.raises(BudgetExceeded, match="order 64"):
            ledger.charge(unit)  # ...the filter at its fixed order does not
        # the guarantee is the declared budget, not the realised spend
        report = ledger.report()
        assert report.guarantee.epsilon == 3.0 and report.guarantee.basis == "renyi-filter"
        assert report.guarantee.order == 64.0 and report.epsilon_spent < 1.5


def test_the_budget_converts_back_to_the_declared_epsilon():
    for epsilon, order in [(0.5, 1.5), (2.0, 8.0), (8.0, 32.0)]:
        b = rdp_budget(epsilon, DELTA, order)
        assert epsilon_from_rdp([order], [b], DELTA)[0] == pytest.approx(epsilon, rel=1e-12)


def test_the_order_is_chosen_from_the_planned_workload():
    planned = gaussian_charge(40.0 / math.sqrt(2), count=640, label="gnmax")  # 640 GNMax answers, σ = 40
    order = choose_order(planned, 2.0, DELTA)
    ratios = [rdp_budget(2.0, DELTA, lam) / rho for lam, rho in zip(DEFAULT_ORDERS, planned.rdp)]
    assert order == DEFAULT_ORDERS[int(np.argmax(ratios))]
    # The filter at that order admits as much of the workload as composing it in advance
    # would: scaled to fill the budget, its best conversion is exactly ε = 2 at that order.
    most = max(ratios)
    epsilon, at = epsilon_from_rdp(DEFAULT_ORDERS, most * planned.rdp, DELTA)
    assert epsilon == pytest.approx(2.0, rel=1e-9) and at == order
    # scaling a homogeneous workload does not move the order
    assert choose_order(gaussian_charge(40.0 / math.sqrt(2), count=64), 2.0, DELTA) == order
    reserved = filter_for(approximate_dp_charge(0.3, 4e-6, count=3), 2.0, DELTA)
    assert reserved.reserved_delta == 4e-6 and reserved.curve_delta == pytest.approx(6e-6)
    with pytest.raises(ValueError, match="unbounded"):
        choose_order(unbounded_charge("nzc"), 2.0, DELTA)


def test_reopening_restores_exactly(tmp_path):
    path = tmp_path / "ledger.db"
    rng = np.random.default_rng(0)
    with PrivacyLedger(path, DELTA) as ledger:
        for n in range(60):
            kind = n % 4
            if kind == 0:
                charge = gaussian_charge(float(rng.uniform(20, 200)), count=int(rng.integers(1, 50)), label="gnmax")
            elif kind == 1:
                charge = pure_epsilon_charge(float(rng.uniform(0.001, 0.05)), label="counts")
            elif kind == 2:
                charge = approximate_dp_charge(float(rng.uniform(0.01, 0.1)), 1e-9, label="stability", count=2)
            else:
                charge = sampled_gaussian_charge(0.01, float(rng.uniform(0.8, 2.0)), 10, label="dpsgd")
            ledger.charge(charge)
        report, spent = ledger.report(), ledger.spent()
    with PrivacyLedger(path, DELTA) as reopened:
        assert reopened.report() == report  # exact float equality, by_label included
        assert np.array_equal(reopened.spent().rdp, spent.rdp)
        assert reopened.spent().extra_delta == spent.extra_delta
    assert report.charges == 60 and set(report.by_label) == {"gnmax", "counts", "stability", "dpsgd"}


def test_one_label_is_reported_at_the_total_epsilon(tmp_path):
    path = tmp_path / "ledger.db"
    charges = [gaussian_charge(sigma, count=3, label="gnmax") for sigma in (40.0, 55.0, 70.0)]
    with PrivacyLedger(path, DELTA) as ledger:
        for charge in charges:
            report = ledger.charge(charge)
    expected, _ = epsilon_from_rdp(DEFAULT_ORDERS, sum(c.rdp for c in charges), DELTA)
    assert report.epsilon_spent == pytest.approx(expected, rel=1e-12)
    assert report.by_label == {"gnmax": report.epsilon_spent}
    with PrivacyLedger(path, DELTA) as reopened:
        assert reopened.report() == report


def test_refuses_a_file_written_with_other_settings(tmp_path):
    path = tmp_path / "ledger.db"
    grid = [2.0, 16.0, 32.0]
    PrivacyLedger(path, DELTA, budget(4.0, order=16.0), orders=grid).close()
    with pytest.raises(ValueError, match="created with orders"):
        PrivacyLedger(path, DELTA, budget(4.0, order=16.0))
    with pytest.raises(ValueError, match="created with budget"):
        PrivacyLedger(path, DELTA, budget(5.0, order=16.0), orders=grid)
    with pytest.raises(ValueError, match="created with budget"):
        PrivacyLedger(path, DELTA, orders=grid)  # dropping the budget is changing it too
    with pytest.raises(ValueError, match="created with neighbouring"):
        PrivacyLedger(path, DELTA, budget(4.0, order=16.0), neighbouring=Neighbouring.REPLACE_ONE, orders=grid)
    with PrivacyLedger(path, DELTA, budget(4.0, order=16.0), orders=grid) as ledger:
        with pytest.raises(ValueError, match="not on this ledger's RDP orders"):
            ledger.charge(gaussian_charge(5.0))
        ledger.charge(gaussian_charge(5.0, orders=grid))
    with pytest.raises(ValueError, match="not on the ledger's grid"):
        PrivacyLedger(tmp_path / "other.db", DELTA, budget(4.0, order=20.0), orders=grid)


def test_a_charge_for_another_neighbouring_relation_is_refused(tmp_path):
    with PrivacyLedger(tmp_path / "ledger.db", DELTA, budget(5.0)) as ledger:
        with pytest.raises(ValueError, match="'replace-one' neighbours, this ledger composes 'add-remove'"):
            ledger.charge(gaussian_charge(5.0, label="pca", neighbouring=Neighbouring.REPLACE_ONE))
        vote = gaussian_charge(40.0, label="gnmax", neighbouring=Neighbouring.ONE_VOTE)
        with pytest.raises(ValueError, match="'one-vote' neighbours"):
            ledger.charge(vote)
        assert ledger.report().charges == 0
        # restated for records, with the lemma that makes it hold, it is accepted
        report = ledger.charge(vote.for_records("add-remove", "shards are a keyed hash of each record"))
        assert report.charges == 1


def test_no_overshoot_with_32_threads(tmp_path):
    path = tmp_path / "ledger.db"
    filter_ = budget(2.0)
    unit = gaussian_charge(40.0 / math.sqrt(2), count=10, label="gnmax")  # 10 GNMax answers at σ = 40
    fits = fitting(10 * ORDER / 40.0**2, filter_)  # 10 answers cost 10·λ/σ² at the filter's order
    ledger = PrivacyLedger(path, DELTA, filter_)  # the one writer; its threads race on it
    accepted, refused = [], []
    start = threading.Barrier(32)

    def worker(index: int) -> None:
        start.wait()
        for _ in range(fits // 8 + 2):
            try:
                accepted.append(ledger.charge(unit))
            except BudgetExceeded:
                refused.append(index)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(accepted) == fits and refused
    assert max(report.rdp_at_budget_order for report in accepted) <= filter_.rdp_budget
    final = ledger.report()
    assert final.charges == fits and final.rdp_at_budget_order <= filter_.rdp_budget
    ledger.close()
    assert rows(path) == fits
    with PrivacyLedger(path, DELTA, filter_) as reopened:  # the chain the threads wrote checks out
        assert reopened.report() == final


_HOLDER = """
import sys
from conclave.privacy.accounting.ledger import LedgerInUse, PrivacyLedger
try:
    ledger = PrivacyLedger(sys.argv[1], 1e-5)
except LedgerInUse as err:
    print(err, flush=True)
    sys.exit(2)
print("holding", flush=True)
sys.stdin.readline()  # hold the ledger until told (or killed)
"""


def test_one_writer_at_a_time(tmp_path):
    path = tmp_path / "ledger.db"
    with PrivacyLedger(path, DELTA) as ledger:
        ledger.charge(gaussian_charge(10.0, label="g"))
        # a second opener in the same process fails at once, one line naming the file
        in_use = f"ledger {path} is in use: another process (pid {os.getpid()}) holds its lock {path}.lock"
        with pytest.raises(LedgerInUse, match=re.escape(in_use)) as err:
            PrivacyLedger(path, DELTA)
        assert "\n" not in str(err.value)
        with pytest.raises(LedgerInUse):
            PrivacyLedger.open_existing(path)
        # so does another process
        other = subprocess.run([sys.executable, "-c", _HOLDER, str(path)], capture_output=True, text=True, timeout=120)
        assert other.returncode == 2 and other.stdout.strip() == str(err.value)
        assert read_ledger(path).charges == 1  # readers need no lock
        assert ledger.charge(gaussian_charge(10.0, label="g")).charges == 2  # the refused openers changed nothing
    in_memory = [PrivacyLedger(":memory:", DELTA) for _ in range(2)]  # no file, nothing to share
    for ledger in in_memory:
        ledger.close()


def test_the_lock_goes_with_its_holder(tmp_path):
    path = tmp_path / "ledger.db"
    PrivacyLedger(path, DELTA).close()
    PrivacyLedger(path, DELTA).close()  # close() released it
    # A process that holds the ledger and dies (SIGKILL: no cleanup) releases it with its life.
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(LedgerInUse, match=rf"\(pid {holder.pid}\)"):
            PrivacyLedger(path, DELTA)
        assert read_ledger(path).charges == 0
    finally:
        holder.kill()
        holder.wait(timeout=60)
    PrivacyLedger(path, DELTA).close()
    # A child forked while the ledger is open does not keep it locked once the parent closes it.
    ready, started = os.pipe()
    with PrivacyLedger(path, DELTA):
        child = os.fork()
        if child == 0:  # the fork hooks have run by now
            os.write(started, b"x")
            time.sleep(30)
            os._exit(0)
    assert os.read(ready, 1) == b"x"
    try:
        PrivacyLedger(path, DELTA).close()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(ready)
        os.close(started)


def test_worst_case_gates_and_the_actual_charge_is_recorded(tmp_path):
    with PrivacyLedger(tmp_path / "ledger.db", DELTA, budget(1.0)) as ledger:
        actual = gaussian_charge(100.0, count=1, label="confident")
        too_much = gaussian_charge(1.0, count=1, label="confident")
        with pytest.raises(BudgetExceeded):
            ledger.charge(actual, worst_case=too_much)  # the actual would fit; its worst case does not
        assert ledger.report().charges == 0
        report = ledger.charge(actual, worst_case=gaussian_charge(50.0, count=1))
        assert np.allclose(ledger.spent().rdp, actual.rdp) and report.charges == 1
        with pytest.raises(ValueError, match="exceeds the worst case"):
            ledger.charge(too_much, worst_case=actual)
        assert ledger.report().charges == 1


def test_extra_delta_is_split_from_the_curve(tmp_path):
    with PrivacyLedger(tmp_path / "ledger.db", DELTA, budget(5.0, reserved=5e-6)) as ledger:
        ledger.charge(gaussian_charge(3.0, count=2, label="g"))
        report = ledger.charge(approximate_dp_charge(0.2, 4e-6, label="stability"))
        curve = ledger.spent().rdp
        # the curve is converted at δ − Σ extra δ; the total δ is the configured δ
        assert report.epsilon_spent == epsilon_from_rdp(DEFAULT_ORDERS, curve, DELTA - 4e-6)[0]
        assert report.delta == DELTA and report.extra_delta == 4e-6
        assert report.by_label["g"] == epsilon_from_rdp(DEFAULT_ORDERS, gaussian_charge(3.0, count=2).rdp, DELTA)[0]
        with pytest.raises(BudgetExceeded, match="outside the RDP curve, over the 5e-06 reserved"):
            ledger.charge(approximate_dp_charge(0.01, 2e-6, label="stability"))  # Σ extra δ would pass the reserve
        assert ledger.report() == report
        # the guarantee converts the budget at δ − reserved δ: the declared (ε, δ) exactly
        assert report.budget.curve_delta == pytest.approx(5e-6)
        assert epsilon_from_rdp([ORDER], [report.budget.rdp_budget], report.budget.curve_delta)[0] == pytest.approx(5.0)


def test_unbounded_charges(tmp_path):
    nzc = unbounded_charge("constant follows the plurality", label="nzc")
    with PrivacyLedger(tmp_path / "finite.db", DELTA, budget(100.0)) as ledger:
        with pytest.raises(BudgetExceeded, match="no finite privacy guarantee"):
            ledger.charge(nzc)
        assert ledger.report().charges == 0 and ledger.report().bounded
    with PrivacyLedger(tmp_path / "record.db", DELTA) as ledger:
        ledger.charge(gaussian_charge(5.0, label="g"))
        report = ledger.charge(nzc)
        assert report.epsilon_spent == math.inf and not report.bounded and report.order is None
        assert report.by_label["nzc"] == math.inf and math.isfinite(report.by_label["g"])
        assert report.guarantee is None  # no budget: the run's planned work must give the guarantee


def test_agrees_with_google_dp_accounting(tmp_path):
    """The ledger's composition of DP-SGD and Gaussian charges against Google's dp-accounting
    RDP accountant on the same orders (an independent implementation)."""
    import mpmath
    from dp_accounting import dp_event, rdp

    orders = [float(o) for o in DEFAULT_ORDERS if o <= 256]
    q, sigma, steps = 256 / 60000, 1.1, 2000
    with PrivacyLedger(tmp_path / "ledger.db", DELTA, orders=orders) as ledger:
        ledger.charge(sampled_gaussian_charge(q, sigma, steps, orders=orders))
        ledger.charge(gaussian_charge(3.0, count=4, orders=orders))
        ledger.charge(pure_epsilon_charge(0.3, orders=orders))
        spent = ledger.spent().rdp
    accountant = rdp.RdpAccountant(orders)
    accountant.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    accountant.compose(dp_event.GaussianDpEvent(3.0), 4)
    theirs = np.array(accountant._rdp)
    ours = spent - pure_epsilon_charge(0.3, orders=orders).rdp
    integer = np.array([o.is_integer() for o in orders])
    assert np.allclose(ours[integer], theirs[integer], rtol=1e-6)
    # At fractional orders dp-accounting returns an upper bound; ours is the exact value (an
    # mpmath integration of the sampled Gaussian's Rényi moment agrees at order 1.1), so ours
    # is never larger.
    assert np.all(ours[~integer] <= theirs[~integer] * (1 + 1e-9))
    mpmath.mp.dps = 30
    alpha = mpmath.mpf("1.1")
    mixture = lambda z: (1 - q) * mpmath.npdf(z, 0, sigma) + q * mpmath.npdf(z, 1, sigma)
    moment = mpmath.quad(lambda z: mpmath.npdf(z, 0, sigma) * (mixture(z) / mpmath.npdf(z, 0, sigma)) ** alpha,
                         [-mpmath.inf, 0, 1, mpmath.inf])
    exact = float(steps * mpmath.log(moment) / (alpha - 1) + 4 * 1.1 / (2 * 3.0**2))
    assert ours[orders.index(1.1)] == pytest.approx(exact, rel=1e-7)
    # For Laplace dp-accounting uses the exact RDP (Mironov 2017, Prop. 6); ours,
    # min(ε, λε²/2), is a looser bound of the same mechanism: never below it.
    laplace = rdp.RdpAccountant(orders)
    laplace.compose(dp_event.LaplaceDpEvent(1 / 0.3))
    assert np.all(pure_epsilon_charge(0.3, orders=orders).rdp >= np.array(laplace._rdp) - 1e-12)


def test_bad_configuration_and_closed_ledger(tmp_path):
    with pytest.raises(ValueError, match="no RDP budget"):
        RenyiFilter(0.01, DELTA, 1.1)
    with pytest.raises(ValueError, match="delta"):
        PrivacyLedger(tmp_path / "a.db", 1.5)
    with pytest.raises(ValueError, match="differs from the ledger's"):
        PrivacyLedger(tmp_path / "a.db", 1e-6, budget(1.0))
    ledger = PrivacyLedger(tmp_path / "b.db", DELTA, budget(1.0))
    ledger.close()
    with pytest.raises(RuntimeError, match="closed"):
        ledger.report()


def test_answers_are_stored_with_their_charge_and_survive_a_reopening(tmp_path):
    path = tmp_path / "ledger.db"
    with PrivacyLedger(path, DELTA, budget(1.0)) as ledger:
        ledger.charge(gaussian_charge(10.0, label="gnmax"), answers={b"a": 3, b"b": -1})
        with pytest.raises(BudgetExceeded):
            ledger.charge(gaussian_charge(0.5, label="gnmax"), answers={b"c": 7})
        assert ledger.answers.read() == {b"a": 3, b"b": -1}  # the refused charge's answers were not written
        ledger.answers.record({b"d": 2})  # paid for earlier (e.g. by an open stability run)
    with PrivacyLedger(path, DELTA, budget(1.0)) as reopened:
        assert reopened.answers.read() == {b"a": 3, b"b": -1, b"d": 2} and reopened.report().charges == 1
    with sqlite3.connect(path) as db:  # each answer points at the charge that paid for it
        assert db.execute("SELECT COUNT(*) FROM answers JOIN charges ON charges.id = answers.charge_id").fetchone()[0] == 2


def test_read_ledger_reads_the_declared_budget_and_the_charges_without_writing(tmp_path):
    path = tmp_path / "ledger.db"
    declared = budget(2.0, reserved=1e-7)
    with PrivacyLedger(path, DELTA, declared, neighbouring=Neighbouring.ONE_VOTE) as ledger:
        ledger.charge(gaussian_charge(20.0, count=3, label="gnmax", neighbouring=Neighbouring.ONE_VOTE),
                      answers={b"a": 1, b"b": 0})
        ledger.charge(approximate_dp_charge(0.1, 1e-8, label="stability", neighbouring=Neighbouring.ONE_VOTE))
        ledger.answers.record({b"c": 2})
        snapshot = read_ledger(path)  # while the run still holds it open
        report, spent = ledger.report(), ledger.spent()
    before = path.read_bytes()
    again = read_ledger(path)  # after the run closed it: the same, and the file unchanged
    assert (again.charges, again.answers) == (snapshot.charges, snapshot.answers) and path.read_bytes() == before
    assert (snapshot.delta, snapshot.budget, snapshot.neighbouring) == (DELTA, declared, Neighbouring.ONE_VOTE)
    assert snapshot.charges == report.charges == 2 and snapshot.answers == 3
    assert np.array_equal(snapshot.spent.rdp, spent.rdp) and snapshot.spent.extra_delta == spent.extra_delta
    assert np.array_equal(snapshot.by_label["gnmax"].rdp, gaussian_charge(20.0, count=3).rdp)
    assert snapshot.by_label["stability"].extra_delta == 1e-8
    assert snapshot.guarantee == report.guarantee and snapshot.guarantee.basis == "renyi-filter"
    with PrivacyLedger(tmp_path / "record-only.db", DELTA) as ledger:
        ledger.charge(gaussian_charge(20.0, label="gnmax"))
    assert read_ledger(tmp_path / "record-only.db").budget is None
    assert read_ledger(tmp_path / "record-only.db").guarantee is None


def test_read_ledger_refuses_a_missing_file_without_creating_it_and_a_file_that_is_no_ledger(tmp_path):
    with pytest.raises(FileNotFoundError, match="no privacy ledger at"):
        read_ledger(tmp_path / "missing.db")
    assert not (tmp_path / "missing.db").exists()
    (tmp_path / "garbage.db").write_bytes(b"not a database" * 100)
    for open_it in (read_ledger, lambda path: PrivacyLedger(path, DELTA)):
        with pytest.raises(LedgerDamaged, match=r"garbage.db is damaged or is not a privacy ledger: SQLite cannot "
                                                r"read it \(file is not a database\); refusing to use it$"):
            open_it(tmp_path / "garbage.db")
    with sqlite3.connect(tmp_path / "other.db") as db:
        db.execute("CREATE TABLE meta (key TEXT, value TEXT)")
    with pytest.raises(ValueError, match="is not a privacy ledger"):
        read_ledger(tmp_path / "other.db")


# --- a ledger that defends itself: each way of altering the file is refused, in one line ---


def small_ledger(path, answers: bool = True) -> None:
    """Three charges under a budget, the first with answers, then answers paid for earlier."""
    with PrivacyLedger(path, DELTA, budget(2.0)) as ledger:
        ledger.charge(gaussian_charge(20.0, count=4, label="gnmax"), answers={b"a": 3, b"b": 1} if answers else None)
        ledger.charge(gaussian_charge(25.0, count=4, label="gnmax"))
        ledger.charge(pure_epsilon_charge(0.05, label="counts"))
        if answers:
            ledger.answers.record({b"c": 2})


def refused(path, message: str) -> None:
    """Opening to charge, reopening with the stored settings, and reading all refuse ``path``."""
    for open_it in (lambda: PrivacyLedger(path, DELTA, budget(2.0)), lambda: PrivacyLedger.open_existing(path),
                    lambda: read_ledger(path)):
        with pytest.raises(LedgerDamaged) as err:
            open_it()
        assert str(err.value) == f"ledger {path} is damaged: {message}; refusing to use it"


def edit(path, *statements) -> None:
    with sqlite3.connect(path) as db:
        for statement in statements:
            db.execute(*statement) if isinstance(statement, tuple) else db.execute(statement)
    db.close()


def test_overwriting_8_bytes_of_a_stored_rdp_curve_is_refused(tmp_path):
    """The issue's probe: zeroing the RDP of one charge at the budget's order (its cost
    gone, so a service would report less spent and answer past the budget)."""
    path = tmp_path / "ledger.db"
    small_ledger(path)
    spent = read_ledger(path).spent.rdp
    with sqlite3.connect(path) as db:
        blob = bytearray(db.execute("SELECT rdp FROM charges WHERE id = 2").fetchone()[0])
        at = 8 * list(DEFAULT_ORDERS).index(ORDER)
        blob[at : at + 8] = bytes(8)
        db.execute("UPDATE charges SET rdp = ? WHERE id = 2", (bytes(blob),))
    db.close()
    refused(path, "charge 2's checksum does not match (edited or truncated)")
    edit(path, "UPDATE charges SET rdp = zeroblob(8) WHERE id = 2")  # a curve of the wrong length
    refused(path, "charge 2's checksum does not match (edited or truncated)")
    assert spent[list(DEFAULT_ORDERS).index(ORDER)] > 0


def test_one_altered_byte_in_the_file_is_detected(tmp_path):
    path = tmp_path / "ledger.db"
    small_ledger(path)
    curve = gaussian_charge(20.0, count=4).rdp.astype("<f8").tobytes()
    data = bytearray(path.read_bytes())  # closed: the WAL was folded into the file
    at = data.index(curve) + 8 * list(DEFAULT_ORDERS).index(ORDER) + 7  # the top byte of one float
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    refused(path, "charge 1's checksum does not match (edited or truncated)")


@pytest.mark.parametrize("statements,message", [
    (["DELETE FROM charges WHERE id = 2"], "charge 2 is missing (deleted)"),
    (["DELETE FROM charges WHERE id = 3"], "charge 3 is missing (deleted or truncated)"),
    (["DELETE FROM charges", "DELETE FROM sqlite_sequence WHERE name = 'charges'", "DELETE FROM answers"],
     "answer batch 1's checksum does not match (edited or truncated)"),
    (["UPDATE charges SET label = 'counts' WHERE id = 1"], "charge 1's checksum does not match (edited or truncated)"),
    (["UPDATE charges SET created = created - 1 WHERE id = 3"],
     "charge 3's checksum does not match (edited or truncated)"),
    (["UPDATE answers SET answer = 5 WHERE key = x'61'"], "charge 1's checksum does not match (edited or truncated)"),
    (["DELETE FROM answers WHERE key = x'62'"], "charge 1's checksum does not match (edited or truncated)"),
    (["INSERT INTO answers (key, answer, charge_id) VALUES (x'64', 4, 2)"],
     "charge 2's checksum does not match (edited or truncated)"),
    (["UPDATE answers SET answer = 0 WHERE key = x'63'"],
     "answer batch 1's checksum does not match (edited or truncated)"),
    (["INSERT INTO answers (key, answer, charge_id) VALUES (x'64', 4, 9)"],
     "answers point at charge 9, which is not in the ledger"),
    (["DELETE FROM meta WHERE key = 'budget'"], "its settings (meta) do not match their checksum (edited)"),
    (["DELETE FROM meta"], "its settings (meta) are missing"),
    (["DROP TABLE answer_batches"], "its answer_batches table is missing"),
])
def test_edited_rows_are_refused(tmp_path, statements, message):
    path = tmp_path / "ledger.db"
    small_ledger(path)
    edit(path, *statements)
    refused(path, message)


def test_editing_the_budget_in_meta_breaks_the_chain(tmp_path):
    path = tmp_path / "ledger.db"
    small_ledger(path)
    with sqlite3.connect(path) as db:
        stored = json.loads(db.execute("SELECT value FROM meta WHERE key = 'budget'").fetchone()[0])
        wider = json.dumps({**stored, "epsilon": 20.0})
        db.execute("UPDATE meta SET value = ? WHERE key = 'budget'", (wider,))
    db.close()
    with pytest.raises(LedgerDamaged, match=r"its settings \(meta\) do not match their checksum \(edited\)"):
        PrivacyLedger.open_existing(path)
    # Recomputing the settings' checksum is not enough: the first charge is chained to it.
    settings = dict(sqlite3.connect(path).execute("SELECT key, value FROM meta").fetchall())
    edit(path, ("UPDATE meta SET value = ? WHERE key = 'checksum'", (settings_checksum(settings),)))
    with pytest.raises(LedgerDamaged, match="charge 1's checksum does not match"):
        PrivacyLedger.open_existing(path)
    with pytest.raises(LedgerDamaged, match="charge 1's checksum does not match"):
        read_ledger(path)


def test_each_file_has_its_own_identity_and_keeps_it(tmp_path):
    with PrivacyLedger(tmp_path / "a.db", DELTA) as a, PrivacyLedger(tmp_path / "b.db", DELTA) as b:
        assert len(a.ledger_id) == 32 and a.ledger_id != b.ledger_id
        assert read_ledger(tmp_path / "a.db").ledger_id == a.ledger_id
        first = a.ledger_id
    with PrivacyLedger.open_existing(tmp_path / "a.db") as again:
        assert again.ledger_id == first
    other = read_ledger(tmp_path / "b.db").ledger_id
    edit(tmp_path / "a.db", ("UPDATE meta SET value = ? WHERE key = 'ledger_id'", (other,)))
    with pytest.raises(LedgerDamaged, match=r"its settings \(meta\) do not match their checksum"):
        read_ledger(tmp_path / "a.db")


def test_a_truncated_file_is_refused_in_one_line(tmp_path):
    path = tmp_path / "ledger.db"
    with PrivacyLedger(path, DELTA) as ledger:
        for batch in range(20):  # enough answers for the file to span many pages
            ledger.charge(gaussian_charge(40.0, count=100, label="gnmax"),
                          answers={bytes([batch, i]) * 16: i % 10 for i in range(100)})
    data = path.read_bytes()
    for keep in (len(data) // 2, len(data) - 4096):
        path.write_bytes(data[:keep])
        for open_it in (lambda: PrivacyLedger(path, DELTA), lambda: read_ledger(path)):
            with pytest.raises(LedgerDamaged, match=re.escape(f"ledger {path} is damaged: ")) as err:
                open_it()
            assert "\n" not in str(err.value) and str(err.value).endswith("; refusing to use it")


def test_a_ledger_from_before_checksums_is_refused_and_left_as_it_was(tmp_path):
    path = tmp_path / "old.db"
    with PrivacyLedger(tmp_path / "new.db", DELTA, budget(2.0)) as ledger:
        ledger.charge(gaussian_charge(20.0, label="gnmax"))
    with sqlite3.connect(tmp_path / "new.db") as new, sqlite3.connect(path) as old:
        old.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        old.execute("CREATE TABLE charges (id INTEGER PRIMARY KEY AUTOINCREMENT, label TEXT NOT NULL, "
                    "rdp BLOB NOT NULL, extra_delta REAL NOT NULL, unbounded INTEGER NOT NULL, reason TEXT NOT NULL, "
                    "details TEXT NOT NULL, neighbouring TEXT NOT NULL, created REAL NOT NULL)")
        old.execute("CREATE TABLE answers (key BLOB PRIMARY KEY, answer INTEGER NOT NULL, charge_id INTEGER)")
        old.executemany("INSERT INTO meta VALUES (?, ?)", new.execute(
            "SELECT key, value FROM meta WHERE key NOT IN ('checksum', 'ledger_id')").fetchall())
        old.executemany("INSERT INTO charges VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", new.execute(
            "SELECT id, label, rdp, extra_delta, unbounded, reason, details, neighbouring, created FROM charges"))
    new.close()
    old.close()
    before = path.read_bytes()
    message = (f"ledger {path} predates checksums: its charges cannot be verified, and a budget that cannot be "
               "verified is not a budget; refusing to use it")
    for open_it in (lambda: PrivacyLedger(path, DELTA, budget(2.0)), lambda: PrivacyLedger.open_existing(path),
                    lambda: read_ledger(path)):
        with pytest.raises(LedgerDamaged) as err:
            open_it()
        assert str(err.value) == message
    assert path.read_bytes() == before


def test_rows_written_behind_the_writers_back_are_refused(tmp_path):
    path = tmp_path / "ledger.db"
    with PrivacyLedger(path, DELTA, budget(2.0)) as ledger:
        ledger.charge(gaussian_charge(20.0, label="gnmax"), answers={b"a": 1})
        edit(path, "UPDATE answers SET answer = 4")  # the lock is advisory: sqlite3 itself can still write
        with pytest.raises(LedgerDamaged, match="charge 1's checksum does not match"):
            ledger.answers.read()
        edit(path, "INSERT INTO charges SELECT 2, label, rdp, extra_delta, unbounded, reason, details, "
                   "neighbouring, created, checksum FROM charges WHERE id = 1")
        with pytest.raises(LedgerDamaged, match="row 2 of charges was written by something other than this ledger"):
            ledger.charge(gaussian_charge(20.0, label="gnmax"))
