"""A kept ledger cannot be reset: its length and last checksum live outside the file, so a file
deleted, emptied to 0 bytes, shortened by deleting its last rows (with SQLite's sequence reset
to match), emptied of every row, or byte-flipped (in a row or in its schema) is refused in one
line, on open and on read, saying which. A budget changes only as an entry of the chain, whose
guarantee is the largest budget declared. A charge whose record cannot be written is refused
with nothing charged, and nothing fails a charge after its commit."""
from __future__ import annotations

import sqlite3

import pytest

from conclave.privacy.accounting.filter import RenyiFilter
from conclave.privacy.accounting.ledger import (
    BUDGET_CHANGE, BudgetExceeded, LedgerDamaged, LedgerUnwritable, PrivacyLedger, read_history, read_ledger,
)
from conclave.privacy.accounting.ledger_records import LedgerRecords
from conclave.privacy.accounting.rdp import gaussian_charge

DELTA = 1e-5
CHARGE = gaussian_charge(20.0, count=4, label="gnmax")
BUDGET = RenyiFilter(10.0, DELTA, 32.0)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """This test's own Conclave folder, where the records are kept."""
    monkeypatch.setenv("CONCLAVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def kept_ledger(path, charges: int = 5) -> None:
    with PrivacyLedger(path, DELTA, BUDGET, keep_record=True) as ledger:
        for _ in range(charges):
            ledger.charge(CHARGE)


def sql(path, *statements: str) -> None:
    db = sqlite3.connect(path)
    with db:
        for statement in statements:
            db.execute(statement)
    db.close()


def roll_back(path, keep: int) -> None:
    """Delete every charge after ``keep`` and reset SQLite's sequence to match: a valid, shorter chain."""
    sql(path, f"DELETE FROM charges WHERE id > {keep}",
        f"UPDATE sqlite_sequence SET seq = {keep} WHERE name = 'charges'")


def flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(CHARGE.rdp.astype("<f8").tobytes()) + 7
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def flip_the_schema(path) -> None:
    """Flip a byte of a column's name where SQLite keeps the tables' schema: a file, but no ledger."""
    data = bytearray(path.read_bytes())
    data[data.index(b"charge_id INTEGER")] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,message", [
    (lambda p: p.unlink(), "it is missing, but its record (kept outside the file) says it held 5 entries"),
    (lambda p: p.write_bytes(b""), "it is empty, but its record (kept outside the file) says it held 5 entries"),
    (lambda p: roll_back(p, 2), "it holds 2 entries but its record (kept outside the file) says it held 5"),
    (lambda p: roll_back(p, 0), "it holds 0 entries but its record (kept outside the file) says it held 5"),
    (flip_a_byte, "checksum does not match (edited or truncated)"),
    # Before: "it is empty", for a file of 45 kB.
    (flip_the_schema, "it does not read as a privacy ledger (no such column: charge_id), yet a record of it is kept"),
])
def test_a_kept_ledger_deleted_emptied_rolled_back_or_flipped_is_refused_in_one_line(tmp_path, damage, message):
    path = tmp_path / "serve-ledger.sqlite"
    kept_ledger(path)
    damage(path)
    size = path.stat().st_size if path.exists() else None
    opening = [lambda: PrivacyLedger(path, DELTA, BUDGET, keep_record=True)]  # as a service reopening it
    if size is not None:
        opening.append(lambda: read_ledger(path))  # as `conclave budget` and `conclave run` read it
    for open_it in opening:
        with pytest.raises(LedgerDamaged) as refused:
            open_it()
        line = str(refused.value)
        assert "\n" not in line and message in line and line.startswith(f"ledger {path} is damaged: "), line
    assert (path.stat().st_size if path.exists() else None) == size  # no fresh ledger was made in its place


def test_another_ledger_in_its_place_is_refused(tmp_path):
    path, other = tmp_path / "ledger.sqlite", tmp_path / "other.sqlite"
    kept_ledger(path, charges=3)
    with PrivacyLedger(other, DELTA, BUDGET) as ledger:
        for _ in range(4):
            ledger.charge(CHARGE)
    path.write_bytes(other.read_bytes())  # longer, and a valid chain
    with pytest.raises(LedgerDamaged, match="it is another file than the one recorded"):
        read_ledger(path)


def test_a_tail_rewritten_to_the_recorded_length_is_refused(tmp_path, home):
    path = tmp_path / "ledger.sqlite"
    kept_ledger(path, charges=3)
    (record,) = (home / "ledgers").glob("*.json")
    saved = record.read_bytes()
    record.unlink()  # out of the way while the last charge is replaced by a cheaper one
    roll_back(path, 2)
    with PrivacyLedger.open_existing(path) as ledger:
        ledger.charge(gaussian_charge(50.0, label="cheaper"))
    record.write_bytes(saved)
    with pytest.raises(LedgerDamaged, match="its entry 3 is not the one its record saw"):
        read_ledger(path)


def test_a_ledger_without_a_record_starts_afresh_and_one_with_a_record_keeps_it(tmp_path):
    run = tmp_path / "run-ledger.sqlite"  # a run's own ledger: started fresh by every run
    with PrivacyLedger(run, DELTA) as ledger:
        ledger.charge(CHARGE)
    run.unlink()
    with PrivacyLedger(run, DELTA) as ledger:
        assert ledger.report().charges == 0
    assert LedgerRecords().get(run) is None
    kept = tmp_path / "kept.sqlite"
    kept_ledger(kept, charges=1)
    with PrivacyLedger.open_existing(kept) as ledger:  # opened without asking: the record is kept all the same
        ledger.charge(CHARGE)
    assert LedgerRecords().get(kept).entries == 2


def test_the_budget_changes_only_as_an_entry_of_its_chain(tmp_path):
    path = tmp_path / "owner.sqlite"
    unit = gaussian_charge(5.0, label="gnmax")
    with PrivacyLedger(path, DELTA, RenyiFilter(2.0, DELTA, 16.0), keep_record=True) as ledger:
        while ledger.can_afford(unit):
            ledger.charge(unit)
        paid = ledger.report().charges
        with pytest.raises(ValueError, match="labels the budget's changes"):
            ledger.charge(gaussian_charge(5.0, label=BUDGET_CHANGE))
        raised = ledger.change_budget(4.0)
        assert raised.raised and (raised.previous, raised.epsilon, raised.entry) == (2.0, 4.0, paid + 1)
        ledger.charge(unit)  # the raised budget pays again
    with PrivacyLedger.open_existing(path) as ledger:  # reopened: the budget in force is the raised one
        report = ledger.report()
        assert report.budget.epsilon == 4.0 and report.charges == paid + 1 and report.guarantee.epsilon == 4.0
        lowered = ledger.change_budget(3.0)
        assert not lowered.raised
        with pytest.raises(BudgetExceeded):
            while True:
                ledger.charge(unit)
        report = ledger.report()
    # lowered: the limit is 3, the guarantee stays the largest budget declared, 4
    assert report.budget.epsilon == 3.0 and report.guarantee.epsilon == 4.0
    assert [c.epsilon for c in report.changes] == [4.0, 3.0]
    snapshot = read_ledger(path)
    assert snapshot.budget.epsilon == 3.0 and snapshot.guarantee.epsilon == 4.0
    assert snapshot.entries == snapshot.charges + 2
    history = read_history(path)
    assert [r.label for r in history].count(BUDGET_CHANGE) == 2 and len(history) == snapshot.entries
    sql(path, f"UPDATE charges SET details = '{{\"epsilon\": 40.0, \"previous\": 3.0}}' WHERE label = '{BUDGET_CHANGE}'"
              f" AND id = {lowered.entry}")
    with pytest.raises(LedgerDamaged, match=f"charge {lowered.entry}'s checksum does not match"):
        read_ledger(path)


# ---- one truth per charge: a record that cannot be written refuses the charge, and nothing fails after it ----


def block(folder) -> None:
    """A file where the records' folder should be: nothing can be written in it (root or not)."""
    for record in folder.iterdir():
        record.unlink()
    folder.rmdir()
    folder.write_text("not a folder")


def test_a_record_that_cannot_be_written_refuses_the_charge_with_nothing_charged(tmp_path, home):
    # Before: the charge committed, then writing its record raised, and the caller was told nothing was charged.
    path = tmp_path / "serve-ledger.sqlite"
    kept_ledger(path, charges=5)
    with PrivacyLedger(path, DELTA, BUDGET, keep_record=True) as ledger:
        saved = {record.name: record.read_bytes() for record in (home / "ledgers").iterdir()}
        block(home / "ledgers")
        for _ in range(5):
            with pytest.raises(LedgerUnwritable) as refused:
                ledger.charge(CHARGE, answers={b"input": 8})
            line = str(refused.value)
            assert "\n" not in line and line.endswith("nothing was charged") and "cannot be written" in line, line
        assert ledger.report().charges == 5 and ledger.answers.read() == {}
        home.joinpath("ledgers").unlink()  # the operator mends the folder: the same charge is taken, once
        home.joinpath("ledgers").mkdir()
        for name, data in saved.items():
            home.joinpath("ledgers", name).write_bytes(data)
        ledger.charge(CHARGE, answers={b"input": 8})
        assert ledger.report().charges == 6 and ledger.answers.read() == {b"input": 8}
    assert read_ledger(path).charges == 6 and LedgerRecords().get(path).entries == 6
    assert not list((home / "ledgers").glob("*.tmp"))  # no staged record left behind


def test_a_record_not_put_in_place_after_the_commit_keeps_the_charge_and_stops_the_next(tmp_path, home):
    path = tmp_path / "serve-ledger.sqlite"
    kept_ledger(path, charges=2)
    (record,) = (home / "ledgers").glob("*.json")
    with PrivacyLedger(path, DELTA, BUDGET, keep_record=True) as ledger:
        record.unlink()
        record.mkdir()  # a folder in the record's place: staging works, the rename after the commit fails
        ledger.charge(CHARGE, answers={b"input": 8})  # committed: the charge stands, no error after it
        assert ledger.report().charges == 3 and ledger.answers.read() == {b"input": 8}
        with pytest.raises(LedgerUnwritable, match="nothing was charged"):  # the record first, or no charge
            ledger.charge(CHARGE, answers={b"other": 1})
        assert ledger.report().charges == 3 and ledger.answers.read() == {b"input": 8}
        record.rmdir()
        ledger.charge(CHARGE, answers={b"other": 1})
        assert ledger.report().charges == 4
    assert LedgerRecords().get(path).entries == 4 and read_ledger(path).charges == 4
