"""Joining a head with --address (cluster/ray_runtime.py): an address nobody answers at fails in
one line within a minute, a join waits 30 s unless told otherwise, and the embedded start waits
longer than Ray's fixed 30 s for its node, saying how long it has waited. Joining the docs' local
head from a shell that set nothing is checked in test_job_submission.py, on the head its job runs
on (one head for both).
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conclave.cluster import ray_runtime

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# what a shell that followed the docs has not set: the join must find them out itself
UNSET = ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    return {**env, **extra}


def test_an_address_nobody_answers_at_fails_in_one_line_within_a_minute(tmp_path):
    """With the join's wait set short (``$CONCLAVE_JOIN_TIMEOUT_S``: the product's 30 s would be
    waited out in full); the default is checked below."""
    address = f"127.0.0.1:{_free_port()}"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "conclave", "run", str(PROJECT_ROOT / "configs" / "demo.yaml"),
         "--address", address, "--results-dir", str(tmp_path / "results")],
        cwd=PROJECT_ROOT, env=_clean_env(RAY_TMPDIR=str(tmp_path), CONCLAVE_JOIN_TIMEOUT_S="3"),
        capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == ray_runtime.RayJoinFailed.exit_code, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if "could not join" in line]
    assert f"could not join the Ray cluster at {address} within 3 s: nothing accepts connections" in line
    assert result.stderr.rstrip().endswith(line)  # the command's last word
    assert elapsed < 60, elapsed


def test_a_join_waits_30_s_unless_told_otherwise_in_one_line(monkeypatch):
    monkeypatch.delenv(ray_runtime.JOIN_TIMEOUT_ENV, raising=False)
    assert ray_runtime.join_timeout() == ray_runtime.JOIN_TIMEOUT_S == 30.0  # what a user waits at most
    monkeypatch.setenv(ray_runtime.JOIN_TIMEOUT_ENV, "2.5")
    assert ray_runtime.join_timeout() == 2.5
    for bad in ("soon", "0", "-1", "inf", "nan"):
        monkeypatch.setenv(ray_runtime.JOIN_TIMEOUT_ENV, bad)
        with pytest.raises(ray_runtime.RayJoinFailed) as err:
            ray_runtime.join_timeout()
        assert str(err.value) == f"CONCLAVE_JOIN_TIMEOUT_S must be a positive number of seconds, not {bad!r}"


def test_the_embedded_start_waits_for_its_node_past_rays_30_s(monkeypatch):
    from ray._private import services

    waits: list[float] = []
    original = services.get_node

    class FakeRegistration:
        def __init__(self, wait_s: float) -> None:
            waits.append(wait_s)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc) -> None:
            return None

    def fake_init(**kwargs) -> None:
        assert waits == [ray_runtime.START_WAIT_S] and kwargs["address"] == "local"
        raise RuntimeError("stop here")  # nothing is started, nothing recorded

    monkeypatch.setattr(ray_runtime.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_runtime.ray, "init", fake_init)
    monkeypatch.setattr(ray_runtime, "_patient_node_registration", FakeRegistration)
    monkeypatch.setattr(ray_runtime, "reclaim_orphaned_ray", lambda: [])
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_worker_niceness", "0")
    with pytest.raises(RuntimeError, match="stop here"):
        ray_runtime.start_ray()
    assert ray_runtime.START_WAIT_S >= 120 and services.get_node is original


def test_rays_poll_for_the_node_retries_until_the_wait_is_over(monkeypatch):
    from ray._private import services

    answers = iter([RuntimeError("not yet"), RuntimeError("not yet"), {"node_id": "n"}])

    def slow_registration(gcs_address: str, node_id: str) -> dict:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(services, "get_node", slow_registration)
    with ray_runtime._patient_node_registration(60):
        assert services.get_node("gcs", "n") == {"node_id": "n"}  # Ray's loop would have seen no error
    assert services.get_node is slow_registration

    monkeypatch.setattr(services, "get_node", lambda *_: (_ for _ in ()).throw(RuntimeError("never")))
    with ray_runtime._patient_node_registration(0.6), pytest.raises(RuntimeError, match="never"):
        services.get_node("gcs", "n")  # past the wait, Ray's own timeout error follows


def test_a_start_says_how_long_it_has_waited(caplog):
    caplog.set_level(logging.INFO, logger=ray_runtime.log.name)
    with ray_runtime._progress("starting embedded Ray on 127.0.0.1", every=0.2):
        time.sleep(0.5)
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0] == "starting embedded Ray on 127.0.0.1"
    assert any("waited 0 s so far" in message for message in messages[1:-1])
    assert messages[-1].startswith("starting embedded Ray on 127.0.0.1: done in")
