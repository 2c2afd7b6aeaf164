"""The owner decides, through real `conclave` calls, the owners' gateways a run starts on this machine
and real ledger files: a config asking for more than the owner's policy, or for another ledger folder,
is refused in one line before anything trains; an exhausted owner refuses a run before its teachers
train (exit 4); a raised budget is an entry of the owner's ledger and the run states the policy's
budget; every damaged owner ledger, and a ledger another run holds, is one line with exit 2; and a
service's ledger cannot be reset by deleting, emptying or shortening it."""
from __future__ import annotations

import json
import os
import sqlite3
import threading
from pathlib import Path

import pytest
import yaml

from conclave.cluster import cli
from conclave.cluster.config import load_yaml
from conclave.cluster.pipelines import load_pipeline
from conclave.privacy.accounting.owner_policy import OwnerPolicy
from tests.conftest import PROJECT_ROOT
from tests.owner_ledgers import opened

HOSPITALS = PROJECT_ROOT / "configs" / "hospitals.yaml"
DATA_A = PROJECT_ROOT / "examples" / "hospitals" / "data" / "hospital_a"


@pytest.fixture
def node(ray_session, tmp_path, monkeypatch, capsys):
    """hospital_a's policy on this machine: ε 1, its ledger in a folder of this test; no policy for
    hospital_b and hospital_c. Every policy is removed afterwards (the machine's Conclave folder is
    the session's). Training a teacher (behind any gateway) fails the test."""
    from conclave.actors.teacher import TeacherPool

    def no_training(*args, **kwargs):
        raise AssertionError("teachers were trained")

    monkeypatch.setattr(TeacherPool, "train", no_training)
    monkeypatch.chdir(PROJECT_ROOT)
    assert cli.main(["owner", "init", "hospital_a", "--epsilon", "1", "--ledger", str(tmp_path / "node_a"),
                     "--data", str(DATA_A)]) == 0
    capsys.readouterr()
    yield tmp_path
    for policy in OwnerPolicy.file("hospital_a").parent.glob("*.policy.json"):
        policy.unlink()


def small_hospitals(tmp_path, budgets: dict[str, dict | None], owners: tuple[str, ...] = ("hospital_a",)) -> Path:
    """The shipped hospitals config, small (2 teachers an owner, 10 queries at GNMax σ 10: a round
    hospital_a's ε 1 policy pays for), of ``owners`` alone (hospital_a: a refusal by it stops the run
    before any other gateway admits it), with ``budgets`` per owner (None: none in the config);
    hospital_b's and c's ledgers in this test's folders."""
    raw = load_yaml(HOSPITALS)
    raw["owners"] = [owner for owner in raw["owners"] if owner["name"] in owners]
    for owner in raw["owners"]:
        owner["teachers"] = 2
        asked = budgets.get(owner["name"], {"epsilon": 20.0, "directory": str(tmp_path / f"node_{owner['name']}")})
        owner.pop("budget")
        if asked is not None:
            owner["budget"] = asked
    raw["teachers"]["train"]["epochs"] = 2
    raw["mechanism"]["params"]["sigma"] = 10.0
    raw["student"].update(queries=10, batch_size=10, checkpoints=[10])
    raw["student"]["train"]["epochs"] = 2
    path = tmp_path / "hospitals.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run(config: Path, tmp_path: Path, capsys, *flags: str) -> tuple[int, str, str]:
    """``conclave run`` in this process: its status, its one ``conclave:`` line (there must be
    exactly one when it fails, and no Ray text) and its stdout."""
    code = cli.main(["run", str(config), "--results-dir", str(tmp_path / "results"), *flags])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("conclave:")]
    if code != 0:
        assert len(lines) == 1, err
        assert "Traceback" not in err and "ray::" not in err and "Unhandled error" not in err, err
    return code, (lines[0] if lines else ""), out


def a_ledger(tmp_path, charges: int = 3) -> Path:
    """hospital_a's ledger, made on its node (here) by an earlier run that charged ``charges`` times."""
    config = load_pipeline(load_yaml(small_hospitals(tmp_path, {}))).config
    ledger = opened("hospital_a", None, config.planned(), "earlier")
    for _ in range(charges):
        ledger.charge(config.planned(answers=1))
    ledger.close()
    return tmp_path / "node_a" / "hospital_a.sqlite"


def test_a_config_asking_more_than_the_policy_or_another_ledger_folder_is_refused_before_anything_trains(
        node, capsys):
    code, line, _ = run(small_hospitals(node, {"hospital_a": {"epsilon": 20.0}}), node, capsys)
    assert code == 2 and line == ("conclave: run 'hospitals' refused: owner hospital_a: the config asks for a "
                                  "lifetime budget of ε 20, more than the ε 1 its policy allows; a run may ask for "
                                  "less, never more")
    fresh = node / "fresh"
    code, line, _ = run(small_hospitals(node, {"hospital_a": {"epsilon": 1.0, "directory": str(fresh)}}), node, capsys)
    assert code == 2 and f"owner hospital_a: the config names its ledger folder {fresh}" in line
    assert "a run cannot move an owner's ledger" in line
    renamed = load_yaml(small_hospitals(node, {"hospital_a": {"epsilon": 20.0}}))
    renamed["owners"][0]["name"] = "hospital_z"  # its data under a new name: not a fresh budget
    (node / "renamed.yaml").write_text(yaml.safe_dump(renamed))
    code, line, _ = run(node / "renamed.yaml", node, capsys)
    assert code == 2 and "owner hospital_z: its data" in line and "is hospital_a's" in line
    assert not (node / "results" / "hospitals").exists() and not fresh.exists()


def test_serve_is_refused_by_an_owners_policy_before_any_teacher_trains(node, capsys):
    from conclave.cluster import serve_command
    from conclave.cluster.cli import build_parser

    config = small_hospitals(node, {"hospital_a": {"epsilon": 20.0}})
    args = build_parser("serve").parse_args(["serve", str(config), "--ledger", str(node / "serve-ledger.sqlite")])
    assert serve_command.main(args, threading.Event()) == 2
    err = capsys.readouterr().err
    assert "owner hospital_a: the config asks for a lifetime budget of ε 20, more than the ε 1 its policy" in err
    assert "Traceback" not in err


def test_an_exhausted_owner_is_refused_before_teachers_train_and_a_raised_budget_is_recorded_and_stated(
        node, capsys, monkeypatch):
    config_path = small_hospitals(node, {"hospital_a": None})
    config = load_pipeline(load_yaml(config_path)).config
    one_answer = config.planned(answers=1)
    ledger = opened("hospital_a", None, config.planned(), "earlier")
    while ledger.can_afford(one_answer):
        ledger.charge(one_answer)
    ledger.close()

    code, line, _ = run(config_path, node, capsys)
    assert code == 4 and line.startswith("conclave: run 'hospitals' refused by a privacy ledger: owner hospital_a's "
                                         "lifetime budget ε 1 at δ 1e-05 refuses it: ")
    assert line.endswith("nothing was admitted or charged")
    assert cli.main(["budget", str(node / "node_a")]) == 0
    table = capsys.readouterr().out
    assert "hospital_a (EXHAUSTED)" in table and "spent ε (realised, RDP)" in table and "not the guarantee" in table

    assert cli.main(["owner", "raise", "hospital_a", "--epsilon", "30"]) == 0
    assert "lifetime budget raised from ε 1 to ε 30 (recorded as entry" in capsys.readouterr().out
    monkeypatch.undo()  # teachers may train now
    monkeypatch.chdir(PROJECT_ROOT)
    both = small_hospitals(node, {"hospital_a": None}, owners=("hospital_a", "hospital_b"))
    code, line, out = run(both, node, capsys, "--run-name", "after-raise")
    assert code == 0, line
    assert "hospital_a: ε 30 lifetime, " in out
    account = json.loads((node / "results" / "after-raise" / "privacy.json").read_text())["owners"]
    a = account["hospital_a"]
    assert a["guarantee"]["epsilon"] == 30.0 and a["budget_source"]["source"] == "policy"
    assert account["hospital_b"]["budget_source"]["source"] == "config"  # no policy: the config's, said so
    assert "whoever writes the config chooses it" in account["hospital_b"]["budget_source"]["statement"]

    assert cli.main(["budget", str(node / "node_a"), "--history", "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert "earlier" in listed["runs"] and len(listed["runs"]) == 2 and not listed["exhausted"]
    assert listed["spent"]["epsilon"] == pytest.approx(a["spent"]["epsilon"])  # the figure the run reported
    # the raise is an entry of the owner's ledger, on its machine
    assert [h["what"] for h in listed["history"] if h["run"] is None] == ["budget raised: ε 1 → 30"]


def roll_back(path: Path, keep: int) -> None:
    db = sqlite3.connect(path)
    with db:
        db.execute(f"DELETE FROM charges WHERE id > {keep}")
        db.execute(f"UPDATE sqlite_sequence SET seq = {keep} WHERE name = 'charges'")
    db.close()


def flip_a_byte(path: Path) -> None:
    """One byte of the run's name in the charges' details, in every copy the file holds of it
    (SQLite may keep an old copy of a page beside the one in use)."""
    path.write_bytes(path.read_bytes().replace(b"earlier", b"eaRlier"))


DAMAGE = {
    "deleted": (lambda p: p.unlink(), "it is missing, but its record (kept outside the file) says it held 3 entries"),
    "emptied": (lambda p: p.write_bytes(b""), "it is empty, but its record (kept outside the file) says it held 3"),
    "rolled back": (lambda p: roll_back(p, 1), "it holds 1 entries but its record (kept outside the file) says it "
                                               "held 3"),
    "all rows deleted": (lambda p: roll_back(p, 0), "it holds 0 entries but its record"),
    "a byte flipped": (flip_a_byte, "checksum does not match (edited or truncated)"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_owner_ledger_is_one_line_with_exit_2_before_anything_trains(node, capsys, case):
    path = a_ledger(node)
    damage, message = DAMAGE[case]
    damage(path)
    code, line, _ = run(small_hospitals(node, {"hospital_a": None}), node, capsys)
    assert code == 2 and line.startswith(f"conclave: run 'hospitals' refused: owner hospital_a: ledger {path} is "
                                         "damaged: ") and message in line, line
    assert path.exists() != (case == "deleted")  # no fresh ledger was made in its place


def test_a_ledger_another_run_holds_is_one_line_and_the_refused_run_charges_nothing(node, capsys):
    path = a_ledger(node, charges=2)
    config = load_pipeline(load_yaml(small_hospitals(node, {}))).config
    holder = opened("hospital_a", None, config.planned(), "the-other-run")  # another run, in another process
    try:
        code, line, _ = run(small_hospitals(node, {"hospital_a": None}), node, capsys)
        holder.charge(config.planned(answers=1))  # the other run goes on
    finally:
        holder.close()
    assert code == 2 and line == (f"conclave: run 'hospitals' refused: owner hospital_a: ledger {path} is in use: "
                                  f"another process (pid {os.getpid()}) holds its lock {path}.lock; a ledger has one "
                                  "writer at a time")
    assert cli.main(["budget", str(path), "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["spent"]["charges"] == 3 and listed["runs"] == ["earlier", "the-other-run"]


SERVE = {
    "pipeline": "teacher_student", "name": "served", "seed": 1,
    "data": {"name": "digits", "public_size": 200},
    "teachers": {"count": 2, "model": "digits_cnn", "train": {"epochs": 1, "batch_size": 32, "lr": 0.003}},
    "mechanism": {"name": "gnmax", "params": {"sigma": 2.0}},
    "privacy": {"budget": 1000.0, "delta": 1.0e-5},
    "student": {"queries": 40, "batch_size": 40, "model": "digits_cnn",
                "train": {"epochs": 1, "batch_size": 32, "lr": 0.003}},
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_services_ledger_cannot_be_reset(tmp_path, capsys, case):
    """`conclave serve` keeps its ledger's length and last checksum outside it: each damage is
    refused in one line with exit 2, before Ray starts and without a fresh ledger in its place."""
    import ray

    from conclave.cluster import serve_command
    from conclave.cluster.cli import build_parser

    config_path = tmp_path / "serve.yaml"
    config_path.write_text(yaml.safe_dump(SERVE))
    config = load_pipeline(SERVE).config
    path = tmp_path / "serve-ledger.sqlite"
    with config.privacy.open_ledger(path, config.planned(), durable=True) as ledger:  # what an earlier serve kept
        for _ in range(3):
            ledger.charge(config.planned(answers=1))
    if case == "a byte flipped":  # this ledger's charges carry no run name: flip inside the first RDP curve
        data = bytearray(path.read_bytes())
        data[data.index(config.planned(answers=1).rdp.astype("<f8").tobytes()) + 7] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        DAMAGE[case][0](path)
    size = path.stat().st_size if path.exists() else None
    was_running = ray.is_initialized()
    status = serve_command.main(build_parser("serve").parse_args(["serve", str(config_path), "--ledger", str(path)]),
                                threading.Event())
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith(f"conclave: ledger {path} is damaged: "), err
    assert DAMAGE[case][1] in err[0]
    assert ray.is_initialized() == was_running and (path.stat().st_size if path.exists() else None) == size
