"""A failed run is one line with its own exit status and leaves its results folder as it was."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from conclave.actors.owners import OwnerDataError, OwnerDropout
from conclave.actors.placement import PlacementError
from conclave.cluster.active_learning import planned_work
from conclave.cluster.cli import main
from conclave.cluster.config import ConfigError
from conclave.cluster.pipelines import load_pipeline
from conclave.cluster.ray_runtime import RayJoinFailed
from conclave.cluster.results import ResultsFolderInUse, RunDirectory
from conclave.cluster.tracking import TrackingFailed
from conclave.errors import ClusterLost, Interrupted, RunFailed, failure
from conclave.privacy.accounting.ledger import BudgetExceeded, LedgerDamaged, LedgerInUse
from conclave.privacy.accounting.guarantee import worst_case_guarantee
from conclave.privacy.accounting.owner_policy import OwnerRefused
from conclave.privacy.accounting.rdp import epsilon_from_rdp
from tests.terminal import foreground

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
# What can end `conclave run`: each kind's class carries its exit status.
RUN_FAILURES = (RunFailed, ConfigError, OwnerDataError, PlacementError, LedgerDamaged, LedgerInUse, OwnerRefused,
                OwnerDropout, BudgetExceeded, ClusterLost, RayJoinFailed, TrackingFailed, Interrupted, ResultsFolderInUse)


def test_a_staged_run_replaces_the_folder_only_when_it_finishes(tmp_path):
    first = RunDirectory(tmp_path, "run")
    first.write_json("metrics", {"run": 1})
    (first.path / "ledger.sqlite").write_text("durable")
    with pytest.raises(RuntimeError):
        with RunDirectory.staged(tmp_path, "run") as second:
            second.write_json("config", {"run": 2})
            raise RuntimeError("after the start")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no staging folder left
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["ledger.sqlite", "metrics.json"]

    with RunDirectory.staged(tmp_path, "run") as third:
        assert third.durable == tmp_path / "run" and third.path != third.durable
        third.write_json("config", {"run": 3})
    assert third.path == tmp_path / "run"
    # the earlier run's metrics are gone with it; the durable ledger stays
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json", "ledger.sqlite"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_second_run_into_a_folder_in_use_is_refused_in_one_line(tmp_path):
    with RunDirectory.staged(tmp_path, "run") as first:
        with pytest.raises(ResultsFolderInUse) as refused:
            with RunDirectory.staged(tmp_path, "run"):
                pass
        first.write_json("metrics", {"run": 1})  # the first run's staging folder is untouched
    assert failure(refused.value, "run") == (2, f"run 'run' refused: results folder {tmp_path / 'run'} is in use by "
                                                f"another run (pid {os.getpid()}); wait for it to finish or choose "
                                                "another --run-name")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.json"]  # the lock left with the run
    with RunDirectory.staged(tmp_path, "run"):  # and the folder is free again
        pass


def test_a_taken_server_port_is_refused_in_one_line_before_any_teacher_trains(tmp_path, capsys, monkeypatch):
    config = yaml.safe_load((CONFIGS / "digits-teachers.yaml").read_text())
    import conclave.cluster.pipelines.teacher_student as pipeline

    monkeypatch.setattr(pipeline, "train_ensemble", lambda *a: pytest.fail("teachers trained past a taken port"))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        config["server"] = {"port": holder.getsockname()[1]}
        (tmp_path / "taken.yaml").write_text(yaml.safe_dump(config))
        status = main(["run", str(tmp_path / "taken.yaml"), "--results-dir", str(tmp_path / "results")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err == [f"conclave: run 'digits-teachers' refused: could not bind the aggregator to "
                                   f"127.0.0.1:{config['server']['port']}: the address is in use or not on this host"]
    assert not (tmp_path / "results").exists()  # a refused run leaves no folder


def test_each_failure_has_its_status_and_one_line():
    import ray

    cases = [(ConfigError("config.x: bad"), 2), (BudgetExceeded("would pass ε = 2"), 4),
             (OwnerDropout("owner a: its actor left"), 3), (LedgerInUse("held by another run"), 2),
             (ray.exceptions.ActorDiedError(), 5), (KeyError("boom\nsecond line"), 1), (KeyboardInterrupt(), 130)]
    for err, status in cases:
        got, line = failure(err, "r")
        assert got == status and "\n" not in line, (err, line)


def test_the_documented_statuses_are_those_the_failures_carry():
    """docs/main-job.md's table of `conclave run`'s exit statuses: one per kind of failure, from its class."""
    documented = {int(status) for status in re.findall(r"^\| (\d+) \|", (ROOT / "docs" / "main-job.md").read_text(),
                                                        re.MULTILINE)}
    assert documented == {0} | {kind.exit_code for kind in RUN_FAILURES}


def test_rerunning_past_the_budget_is_one_line_and_keeps_the_first_run(ray_session, tmp_path, capsys):
    raw = yaml.safe_load((CONFIGS / "digits-active.yaml").read_text())
    raw["dpsgd"].update(epochs=2, noise_multiplier=1.0, target_epsilon=None)
    raw["selection"].update(strategies=["random"], sizes=[20])
    raw["finetune"].update(epochs=1)
    config = load_pipeline(raw).config
    planned = planned_work(config)
    once = epsilon_from_rdp(planned.orders, planned.rdp, 1e-5)[0]
    twice = epsilon_from_rdp(planned.orders, 2 * np.asarray(planned.rdp), 1e-5)[0]
    raw["privacy"]["budget"] = round((once + twice) / 2, 3)  # one run fits, two do not
    path = tmp_path / "digits-active.yaml"
    path.write_text(yaml.safe_dump(raw))
    results = tmp_path / "results"

    assert main(["run", str(path), "--results-dir", str(results)]) == 0
    folder = results / "digits-active"
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.name.startswith("ledger")}
    assert {"config.json", "metrics.json", "privacy.json"} <= set(before)
    capsys.readouterr()

    assert main(["run", str(path), "--results-dir", str(results)]) == BudgetExceeded.exit_code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "refused by a privacy ledger" in err, err
    after = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.name.startswith("ledger")}
    assert after == before  # no config of the refused run beside the first run's metrics
    assert sorted(p.name for p in results.iterdir()) == ["digits-active"]
    assert json.loads((folder / "privacy.json").read_text())["spent"]["charges"] >= 1


def test_a_damaged_durable_ledger_is_refused_in_one_line_before_ray_starts(tmp_path, capsys, monkeypatch):
    """The durable ledger a run would charge, one stored charge edited: exit 2, one line, no Ray."""
    import sqlite3

    import conclave.cluster.ray_runtime as ray_runtime

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started for a run on a damaged ledger")

    monkeypatch.setattr(ray_runtime, "start_ray", no_ray)
    raw = yaml.safe_load((CONFIGS / "digits-active.yaml").read_text())
    path = tmp_path / "digits-active.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_pipeline(raw).config
    ledger_file = tmp_path / "results" / "digits-active" / "ledger.sqlite"
    ledger_file.parent.mkdir(parents=True)
    with config.privacy.open_ledger(ledger_file, planned_work(config)) as ledger:
        ledger.charge(planned_work(config))
    with sqlite3.connect(ledger_file) as db:  # 8 bytes of the stored curve set to zero
        (curve,) = db.execute("SELECT rdp FROM charges WHERE id = 1").fetchone()
        db.execute("UPDATE charges SET rdp = ? WHERE id = 1", (bytes(8) + curve[8:],))
    code = main(["run", str(path), "--results-dir", str(tmp_path / "results")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("conclave: run 'digits-active' refused: ledger ") and "is damaged" in lines[0]


def test_serve_on_a_port_another_server_holds_or_a_ledger_another_serve_holds_fails_before_ray(tmp_path, capsys):
    """Two `conclave serve` on one port, or on one ledger: the second fails at once, one line."""
    import socket

    import ray

    from conclave.privacy.accounting.ledger import PrivacyLedger

    was_running = ray.is_initialized()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code = main(["serve", str(CONFIGS / "digits-teachers.yaml"), "--port", str(port), "--ledger", str(tmp_path / "l.sqlite")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"conclave: could not bind the aggregator to 127.0.0.1:{port}: the address is in use " \
                                 "or not on this host"
    with PrivacyLedger(tmp_path / "held.sqlite", 1e-5):  # another serve's ledger, open
        code = main(["serve", str(CONFIGS / "digits-teachers.yaml"), "--port", "0", "--ledger", str(tmp_path / "held.sqlite")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "is in use" in err, err
    assert ray.is_initialized() == was_running  # refused before Ray started


def test_a_second_run_on_the_same_durable_ledger_publishes_a_guarantee_covering_both(ray_session, tmp_path):
    raw = yaml.safe_load((CONFIGS / "digits-active.yaml").read_text())
    raw["dpsgd"].update(epochs=2, noise_multiplier=1.0, target_epsilon=None)
    raw["selection"].update(strategies=["random"], sizes=[20])
    raw["finetune"].update(epochs=1)
    raw["privacy"]["budget"] = None  # the guarantee is then the worst case of what the ledger holds
    path = tmp_path / "digits-active.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_pipeline(raw).config
    planned = planned_work(config)
    results = tmp_path / "results"
    epsilons = []
    for _ in range(2):
        assert main(["run", str(path), "--results-dir", str(results)]) == 0
        epsilons.append(json.loads((results / "digits-active" / "privacy.json").read_text())["guarantee"]["epsilon"])
    # a fixed DP-SGD schedule, then two as the ledger holds them: their privacy-loss distributions
    # (the ledger keeps each charge's Gaussian releases), below the RDP figures
    once, twice = (worst_case_guarantee(planned.scaled(n), 1e-5).epsilon for n in (1, 2))
    assert once < epsilon_from_rdp(planned.orders, planned.rdp, 1e-5)[0]
    assert epsilons == [pytest.approx(once, rel=1e-6), pytest.approx(twice, rel=1e-6)]


def test_a_refused_run_leaves_no_folder_it_made(tmp_path):
    with pytest.raises(RuntimeError):
        with RunDirectory.staged(tmp_path / "results" / "nested", "run"):
            raise RuntimeError("refused before anything was written")
    assert not any(tmp_path.iterdir())
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(RuntimeError):
        with RunDirectory.staged(kept, "run") as run:
            (run.durable / "ledger.sqlite").write_text("what the failed run was charged")
            raise RuntimeError("after a charge")
    assert [p.name for p in kept.iterdir()] == ["run"] and [p.name for p in (kept / "run").iterdir()] == [
        "ledger.sqlite"]


@pytest.mark.parametrize("after", [0.5, 1.5, 3.0])
def test_ctrl_c_while_the_demo_loads_is_one_line_and_status_130(tmp_path, after):
    """Ctrl-C while the command, torch, Ray and the data load: before, a traceback (torch's import,
    or scipy's "ImportError: initialization failed") or an exit by SIGINT; now the one line."""
    process = foreground(
        [sys.executable, "-m", "conclave.cluster.cli", "demo", "--results-dir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        time.sleep(after)
        os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole group
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = output.decode(errors="replace")
    assert process.returncode == 130 and "Traceback" not in text, text
    assert text.strip().splitlines()[-1].startswith("conclave: ") and "interrupted" in text, text
    assert not (tmp_path / "demo").exists()  # nothing ran to the end
