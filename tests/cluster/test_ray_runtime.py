"""The embedded Ray we start must listen on loopback only (Ray 2.60 binds the external
interface by default; see cluster/ray_runtime.py)."""
from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _listening_addresses(process: psutil.Process) -> list[str]:
    try:
        connections = process.net_connections(kind="inet")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
    return [c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN]


def test_every_ray_listener_is_on_loopback(ray_session):
    @ray_session.remote
    def ping() -> int:
        return 1

    assert ray_session.get(ping.remote()) == 1  # a worker process exists and listens too
    processes = [psutil.Process(), *psutil.Process().children(recursive=True)]
    addresses = [ip for p in processes for ip in _listening_addresses(p)]
    assert addresses, "expected Ray's GCS, raylet and workers to be listening"
    for ip in addresses:
        ip = ip.removeprefix("::ffff:")
        assert ipaddress.ip_address(ip).is_loopback, f"a Ray process listens on {ip}"


DRIVER = """
import json, os, sys, time
import ray
from conclave.cluster.ray_runtime import start_ray
if sys.argv[1] == "bare":
    ray.init(logging_level="WARNING")
else:
    start_ray(num_cpus=1, temp_dir=sys.argv[2])
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address, "pid": os.getpid()}), flush=True)
time.sleep(300)
"""


def _driver(mode: str, tmp_path: Path) -> tuple[subprocess.Popen, dict]:
    """A Ray driver in a process of its own, whose default Ray address file points at the
    test session's cluster (as ``ray start --head`` on the machine would leave it)."""
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path / "tmp")}
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    process = subprocess.Popen([sys.executable, "-c", DRIVER, mode, ray_dir], env=env, cwd=PROJECT_ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    assert line, f"the {mode} driver printed nothing: {process.stderr.read()[-2000:] if process.poll() else ''}"
    return process, json.loads(line)


def test_embedded_ray_never_joins_a_cluster_it_was_not_told_about_and_a_killed_runs_leftovers_are_stopped(
        ray_session, tmp_path):
    from conclave.cluster.ray_runtime import reclaim_orphaned_ray

    session = ray_session.get_runtime_context().gcs_address
    (tmp_path / "tmp" / "ray").mkdir(parents=True)
    (tmp_path / "tmp" / "ray" / "ray_current_cluster").write_text(session)
    bare, joined = _driver("bare", tmp_path)  # the trap: a bare ray.init() joins the session's cluster
    bare.kill()
    bare.wait()
    assert joined["gcs"] == session
    embedded, started = _driver("embedded", tmp_path)
    try:
        assert started["gcs"] != session  # its own cluster, where the teachers' shards stay
        record = Path(tempfile.gettempdir()) / f"conclave-ray-{os.getuid()}" / f"{started['pid']}.json"
        recorded = json.loads(record.read_text())["processes"]
        assert {"gcs_server", "raylet"} <= {p["name"] for p in recorded}
    finally:
        embedded.send_signal(signal.SIGKILL)
        embedded.wait()
    time.sleep(2)
    survivors = {p["pid"] for p in recorded if _alive(p)}  # measured: Ray's agents outlive a killed driver
    stopped = reclaim_orphaned_ray()
    assert survivors and survivors <= set(stopped) and not any(_alive(p) for p in recorded)
    assert not record.exists()
    assert ray_session.get(ray_session.remote(lambda: 1).remote()) == 1  # the session's own Ray untouched


def _alive(record: dict) -> bool:
    """Running (a zombie holds no port; reaping it is its parent's job)."""
    try:
        process = psutil.Process(record["pid"])
        return abs(process.create_time() - record["create_time"]) < 0.01 and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
