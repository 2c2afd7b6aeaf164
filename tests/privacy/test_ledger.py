"""The durable ledger: refusals record nothing, reopening restores exactly, concurrent charges
never overshoot, and δ is split between the RDP curve and the extra δ's as documented."""
from __future__ import annotations

import math
import sqlite3
import subprocess
import sys
import threading

import numpy as np
import pytest

from privacy.accounting.ledger import BudgetExceeded, PrivacyLedger
from privacy.accounting.rdp import (
    DEFAULT_ORDERS,
    approximate_dp_charge,
    epsilon_from_rdp,
    gaussian_charge,
    pure_epsilon_charge,
    sampled_gaussian_charge,
    unbounded_charge,
)

DELTA = 1e-5


def rows(path) -> int:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT COUNT(*) FROM charges").fetchone()[0]


def test_durability_settings(tmp_path):
    path = tmp_path / "ledger.db"
    with PrivacyLedger(path, 1.0, DELTA) as ledger:
        assert ledger._connection().execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_over_budget_refusal_records_nothing(tmp_path):
    path = tmp_path / "ledger.db"
    with PrivacyLedger(path, epsilon_limit=1.0, delta=DELTA) as ledger:
        first = ledger.charge(gaussian_charge(10.0, count=5, label="small"))
        assert 0 < first.epsilon < 1.0 and first.charges == 1
        assert not ledger.can_afford(gaussian_charge(1.0, label="big"))
        with pytest.raises(BudgetExceeded, match=r"'big' would bring epsilon to .* over the limit 1"):
            ledger.charge(gaussian_charge(1.0, label="big"))
        assert ledger.report() == first
        assert rows(path) == 1
    with PrivacyLedger(path, epsilon_limit=1.0, delta=DELTA) as reopened:
        assert reopened.report() == first


def test_reopening_restores_exactly(tmp_path):
    path = tmp_path / "ledger.db"
    rng = np.random.default_rng(0)
    with PrivacyLedger(path, epsilon_limit=math.inf, delta=DELTA) as ledger:
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
    with PrivacyLedger(path, epsilon_limit=math.inf, delta=DELTA) as reopened:
        assert reopened.report() == report  # exact float equality, by_label included
        assert np.array_equal(reopened.spent().rdp, spent.rdp)
        assert reopened.spent().extra_delta == spent.extra_delta
    assert report.charges == 60 and set(report.by_label) == {"gnmax", "counts", "stability", "dpsgd"}


def test_refuses_a_file_written_on_other_orders(tmp_path):
    path = tmp_path / "ledger.db"
    PrivacyLedger(path, 1.0, DELTA, orders=[2.0, 4.0, 8.0]).close()
    with pytest.raises(ValueError, match="different grid of RDP orders"):
        PrivacyLedger(path, 1.0, DELTA)
    with PrivacyLedger(path, 10.0, DELTA, orders=[2.0, 4.0, 8.0]) as ledger:
        with pytest.raises(ValueError, match="not on this ledger's RDP orders"):
            ledger.charge(gaussian_charge(5.0))
        ledger.charge(gaussian_charge(5.0, orders=[2.0, 4.0, 8.0]))


def test_no_overshoot_with_32_threads(tmp_path):
    path = tmp_path / "ledger.db"
    limit = 2.0
    unit = gaussian_charge(40.0 / math.sqrt(2), count=10, label="gnmax")  # 10 GNMax answers at σ = 40
    # How many units fit, computed on paper: the largest k with ε(k·curve) ≤ limit.
    fits = max(k for k in range(1, 1000) if epsilon_from_rdp(DEFAULT_ORDERS, k * unit.rdp, DELTA)[0] <= limit)
    # Four ledger objects on one file: separate SQLite connections, as separate processes have.
    ledgers = [PrivacyLedger(path, limit, DELTA) for _ in range(4)]
    accepted, refused = [], []
    start = threading.Barrier(32)

    def worker(index: int) -> None:
        ledger = ledgers[index % 4]
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
    assert max(report.epsilon for report in accepted) <= limit
    for ledger in ledgers:
        final = ledger.report()
        assert final.charges == fits and final.epsilon <= limit
        ledger.close()
    assert rows(path) == fits


_CHARGER = """
import math, os, sys, time
from privacy.accounting.ledger import BudgetExceeded, PrivacyLedger
from privacy.accounting.rdp import gaussian_charge
path, go, attempts = sys.argv[1], sys.argv[2], int(sys.argv[3])
ledger = PrivacyLedger(path, 2.0, 1e-5)
charge = gaussian_charge(40.0 / math.sqrt(2), count=1, label="gnmax")
print("ready", flush=True)
while not os.path.exists(go):  # start together, so the processes race
    time.sleep(0.01)
accepted = 0
for _ in range(attempts):
    try:
        ledger.charge(charge)
        accepted += 1
    except BudgetExceeded:
        pass
print(accepted, flush=True)
"""


def test_no_overshoot_with_4_processes(tmp_path):
    path, go = tmp_path / "ledger.db", tmp_path / "go"
    unit = gaussian_charge(40.0 / math.sqrt(2), count=1)  # one GNMax answer at σ = 40
    fits = max(k for k in range(1, 2000) if epsilon_from_rdp(DEFAULT_ORDERS, k * unit.rdp, DELTA)[0] <= 2.0)
    PrivacyLedger(path, 2.0, DELTA).close()  # create the file once, so the processes only race on charges
    processes = [
        subprocess.Popen([sys.executable, "-c", _CHARGER, str(path), str(go), str(fits // 2)], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    for process in processes:
        assert process.stdout.readline().strip() == "ready"
    go.touch()
    accepted = [int(process.communicate(timeout=300)[0]) for process in processes]
    assert all(process.returncode == 0 for process in processes)
    assert sum(accepted) == fits == rows(path)  # 4 × fits/2 attempts, exactly `fits` accepted
    assert sum(1 for a in accepted if a > 0) >= 2  # the processes really did interleave
    with PrivacyLedger(path, 2.0, DELTA) as ledger:
        assert ledger.report().epsilon <= 2.0


def test_worst_case_gates_and_the_actual_charge_is_recorded(tmp_path):
    with PrivacyLedger(tmp_path / "ledger.db", 1.0, DELTA) as ledger:
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
    with PrivacyLedger(tmp_path / "ledger.db", 5.0, DELTA) as ledger:
        ledger.charge(gaussian_charge(3.0, count=2, label="g"))
        report = ledger.charge(approximate_dp_charge(0.2, 4e-6, label="stability"))
        curve = ledger.spent().rdp
        # the curve is converted at δ − Σ extra δ; the total δ is the configured δ
        assert report.epsilon == epsilon_from_rdp(DEFAULT_ORDERS, curve, DELTA - 4e-6)[0]
        assert report.delta == DELTA
        assert report.by_label["g"] == epsilon_from_rdp(DEFAULT_ORDERS, gaussian_charge(3.0, count=2).rdp, DELTA)[0]
        with pytest.raises(BudgetExceeded, match="delta"):
            ledger.charge(approximate_dp_charge(0.01, 7e-6, label="stability"))  # Σ extra δ would pass δ
        assert ledger.report() == report


def test_unbounded_charges(tmp_path):
    nzc = unbounded_charge("constant follows the plurality", label="nzc")
    with PrivacyLedger(tmp_path / "finite.db", 100.0, DELTA) as ledger:
        with pytest.raises(BudgetExceeded, match="no finite privacy guarantee"):
            ledger.charge(nzc)
        assert ledger.report().charges == 0 and ledger.report().sound
    with PrivacyLedger(tmp_path / "report.db", math.inf, DELTA) as ledger:
        ledger.charge(gaussian_charge(5.0, label="g"))
        report = ledger.charge(nzc)
        assert report.epsilon == math.inf and not report.sound and report.order is None
        assert report.by_label["nzc"] == math.inf and math.isfinite(report.by_label["g"])


def test_bad_configuration_and_closed_ledger(tmp_path):
    with pytest.raises(ValueError, match="epsilon_limit"):
        PrivacyLedger(tmp_path / "a.db", 0.0, DELTA)
    with pytest.raises(ValueError, match="delta"):
        PrivacyLedger(tmp_path / "a.db", 1.0, 1.5)
    ledger = PrivacyLedger(tmp_path / "b.db", 1.0, DELTA)
    ledger.close()
    with pytest.raises(RuntimeError, match="closed"):
        ledger.report()
