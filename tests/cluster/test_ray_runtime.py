"""The embedded Ray we start must listen on loopback only (Ray 2.60 binds the external
interface by default; see cluster/ray_runtime.py)."""
from __future__ import annotations

import ipaddress

import psutil


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
