"""No private artefact outlives its run: the teachers' checkpoints live in a 0700 folder of the
run on the node, removed at shutdown, and what a killed run left is removed by the next start
(only folders whose every marker names a dead process of this host)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import psutil
import pytest
import ray

from conclave.actors import run_folder
from conclave.actors.teacher import TeacherPool, TeacherSource
from conclave.learning.data import make_splits
from conclave.learning.train_config import TrainConfig

TRAIN = TrainConfig(epochs=1, batch_size=32, lr=3e-3, seed=0)
SOURCE = TeacherSource("digits", None, public_size=200, num_teachers=2, seed=0)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _left_by(folder: Path, pid: int, create_time: float, host: str | None = None) -> Path:
    """A run folder as a run of process ``pid`` leaves it: a checkpoint and the process's marker."""
    folder.mkdir(mode=0o700)
    (folder / "teacher-0.pt").write_bytes(b"a private model")
    marker = {"run": folder.name, "host": host or socket.gethostname(), "pid": pid, "create_time": create_time}
    (folder / f".owner-{pid}.json").write_text(json.dumps(marker))
    return folder


def _pid(actor) -> int | None:
    """The process id of ``actor`` now (None while it is down or restarting)."""
    try:
        return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=2)
    except ray.exceptions.RayError:
        return None


def _dead_process() -> tuple[int, float]:
    """The PID and start time of a process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    create_time = psutil.Process(child.pid).create_time()
    child.kill()
    child.wait()
    return child.pid, create_time


def test_a_pools_start_clears_a_killed_runs_folder_and_its_checkpoints_are_private_survive_restarts_and_go(
        ray_session):
    """One pool's life: its start removes what a killed run left (and nothing in use); its
    checkpoints sit in a 0700 folder; an actor Ray restarts, and one past its restarts that the
    pool starts again, both reload their teachers from it; shutdown removes it."""
    base = run_folder.base_folder()
    base.mkdir(mode=0o700, exist_ok=True)
    me = psutil.Process()
    names = {kind: f"test-{kind}-{uuid.uuid4().hex[:8]}" for kind in ("dead", "live", "unmarked", "elsewhere")}
    dead = _left_by(base / names["dead"], *_dead_process())
    live = _left_by(base / names["live"], me.pid, me.create_time())
    elsewhere = _left_by(base / names["elsewhere"], *_dead_process(), host="another-host.invalid")
    unmarked = base / names["unmarked"]
    unmarked.mkdir(mode=0o700)
    pool = folder = None
    try:
        pool = TeacherPool.of_source(SOURCE, 2, "digits_cnn", TRAIN, num_actors=2, num_cpus_per_actor=0.25)
        assert not dead.exists()  # its process is gone: the private model went with the folder
        assert live.is_dir() and elsewhere.is_dir() and unmarked.is_dir()  # in use, not this host's, not ours

        folder = Path(pool.checkpoint_dir)
        pool.train(progress=False)
        assert folder.parent == run_folder.base_folder() and _mode(folder.parent) == _mode(folder) == 0o700
        assert sorted(p.name for p in folder.glob("*.pt")) == ["teacher-0.pt", "teacher-1.pt"]
        assert len(list(folder.glob(".owner-*.json"))) == 2  # one marker per actor process
        inputs = make_splits("digits", public_size=200, seed=0).public.x[:4]
        before = pool.votes(inputs)

        old_pid = _pid(pool.roster.actors[0])
        ray.kill(pool.roster.actors[0], no_restart=False)  # Ray restarts it; it reloads its teacher from the folder
        deadline = time.monotonic() + 120  # ray.kill returns at once: wait for the new process, then readiness
        while not (_pid(pool.roster.actors[0]) not in (None, old_pid) and pool.ready()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _pid(pool.roster.actors[0]) not in (None, old_pid) and pool.ready()
        np.testing.assert_array_equal(pool.votes(inputs), before)
        assert len(list(folder.glob(".owner-*.json"))) == 2  # the dead process's marker went with it

        gone = pool.roster.actors[0]
        ray.kill(gone, no_restart=True)  # as after its last restart: Ray will not bring it back
        deadline = time.monotonic() + 120  # ray.kill returns at once: wait for the replacement, then readiness
        while not (pool.ready() and pool.roster.actors[0] is not gone) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert pool.roster.actors[0] is not gone and pool.ready()
        np.testing.assert_array_equal(pool.votes(inputs), before)  # the same teachers, not retrained
    finally:
        if pool is not None:
            pool.shutdown()
        for planted in (dead, live, elsewhere, unmarked):
            shutil.rmtree(planted, ignore_errors=True)
    assert not folder.exists()


def test_a_folder_is_released_by_its_last_holder_and_a_reused_pid_is_not_its_process(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # a node of its own
    folder = run_folder.claim("run-a")
    assert folder == tmp_path / f"conclave-private-{os.getuid()}" / "run-a" and _mode(folder) == 0o700
    other = psutil.Process(os.getppid())  # a live process of the same run
    (folder / f".owner-{other.pid}.json").write_text(json.dumps(
        {"run": "run-a", "host": socket.gethostname(), "pid": other.pid, "create_time": other.create_time()}))
    run_folder.release(folder)
    assert folder.is_dir()  # the other holder still works in it
    (folder / f".owner-{other.pid}.json").unlink()
    run_folder.release(folder)
    assert not folder.exists()
    me = psutil.Process()
    reused = _left_by(folder.parent / "run-b", me.pid, me.create_time() - 1000)  # same PID, an earlier process
    assert run_folder.reclaim() == [reused] and not reused.exists()


def test_a_base_folder_that_is_not_the_users_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_folder.base_folder().symlink_to(elsewhere)  # planted by someone to catch private models
    with pytest.raises(OSError, match="not a directory of this user's"):
        run_folder.claim("run-a")
    assert not any(elsewhere.iterdir())
    with pytest.raises(ValueError, match="run id"):
        run_folder.claim("../escape")
