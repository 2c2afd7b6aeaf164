"""Shared fixtures: one real local Ray for the whole session, on loopback, in a temp dir.

MNIST lives at ../shared/data/mnist beside the project for tests that need real data. The
owners' lifetime ledgers and the driver's records of them (``$CONCLAVE_HOME``) go to a
temporary folder of the session, set before Ray or any ``conclave`` process starts, so tests
never touch the ledgers of the machine's user; it goes when the session ends.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONCLAVE_HOME = tempfile.mkdtemp(prefix="conclave-home-")
os.environ["CONCLAVE_HOME"] = CONCLAVE_HOME
MNIST_DIR = PROJECT_ROOT.parent / "shared" / "data" / "mnist"


def pytest_unconfigure(config) -> None:
    shutil.rmtree(CONCLAVE_HOME, ignore_errors=True)


_opened: list[str] | None = None  # the running test's record of opened files, if it asked for one


def _record_open(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and args and isinstance(args[0], str):
        if not threading.current_thread().name.startswith(GATEWAY_THREADS):
            _opened.append(args[0])


# The threads of an owner's gateway that a run starts in its own process (owners named by their
# data): they are the owner's, and read its files; the driver's are every other.
GATEWAY_THREADS = "gateway_"  # grpc server threads of cluster.gateway.server (the coordinator's: "gateways_")


@pytest.fixture
def driver_opens():
    """The files this process's driver opens while the test runs (not the owners' gateways a run
    starts in it: ``GATEWAY_THREADS``), as resolved paths. An audit hook sees every ``open`` but
    cannot be removed, so one is installed once and records only for the test that asks."""
    global _opened
    if not getattr(sys, "_conclave_open_hook", False):
        sys.addaudithook(_record_open)
        sys._conclave_open_hook = True
    _opened = []
    record = _opened
    try:
        yield _ResolvedPaths(record)
    finally:
        _opened = None


@pytest.fixture
def run_config_opening(tmp_path, monkeypatch, capsys, driver_opens):
    """``run(config)``: ``conclave run config`` from the project root (the configs' paths are
    relative to it), results under ``tmp_path``; it must succeed, and it returns the files the
    driver opened meanwhile."""
    from conclave.cluster import cli

    def run(config: Path) -> set[str]:
        monkeypatch.chdir(PROJECT_ROOT)
        code = cli.main(["run", str(config), "--results-dir", str(tmp_path)])
        assert code == 0, capsys.readouterr().err
        return driver_opens()
    return run


class _ResolvedPaths:
    def __init__(self, raw: list[str]) -> None:
        self._raw = raw

    def __call__(self) -> set[str]:
        return {str(Path(p).resolve()) for p in list(self._raw)}


@pytest.fixture(autouse=True)
def stop_signals_restored():
    """SIGINT and SIGTERM as they were before each test. An in-process ``conclave serve`` ignores
    them while it undoes its start (on purpose), and a later test's child processes would inherit
    that: a Ctrl-C test then runs its child to the end."""
    import signal

    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    yield
    for number, handler in before.items():
        signal.signal(number, handler)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Ray workers already get one thread per CPU they hold; a driver that also trains with
    torch's default threads oversubscribes two cores and slows everything down many-fold."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_session():
    """A real embedded Ray cluster (2 CPUs, loopback only), started once per test session."""
    import ray

    from conclave.cluster.ray_runtime import start_ray

    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    os.environ["RAY_TMPDIR"] = temp_dir
    start_ray(num_cpus=2, temp_dir=temp_dir)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)  # its logs and sockets: 20 MB a session


@pytest.fixture(scope="session")
def trained_teachers(tmp_path_factory) -> Path:
    """The ``teachers`` fixture's saved models, for pools of the same teachers that restore them."""
    return tmp_path_factory.mktemp("trained-teachers")


@pytest.fixture(scope="session")
def teachers(ray_session, trained_teachers, tmp_path_factory):
    """Four real digits-CNN teachers on one Ray actor, trained once and shared by every module that
    asks (one actor start a session, not one a module). The actor reserves no CPU: it idles between
    those modules, and a reservation held all session would keep CPU from other tests' actors; it
    votes with one torch thread either way."""
    from conclave.actors.teacher import TeacherPool, TeacherSource
    from conclave.learning.train_config import TrainConfig

    folder = tmp_path_factory.mktemp("teachers")
    # The whole digits train set in 4 shards (public_size only cuts the test set).
    source = TeacherSource("digits", None, public_size=100, num_teachers=4, seed=0)
    pool = TeacherPool.of_source(
        source, 4, "digits_cnn", TrainConfig(epochs=2, batch_size=16, lr=1e-2),
        num_actors=1, seed=0, num_cpus_per_actor=0.0, checkpoint_dir=str(folder),
    )
    pool.train(progress=False)
    for saved in folder.glob("teacher-*.pt"):
        shutil.copy(saved, trained_teachers)
    yield pool
    pool.shutdown()


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    if not (MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.fail(f"real MNIST expected at {MNIST_DIR} (shared/data/mnist)")
    return MNIST_DIR
