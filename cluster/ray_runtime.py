"""Starting or joining Ray, with local traffic kept on loopback.

With no address, ``ray.init()`` starts an embedded single-node cluster. Ray 2.60 binds the
machine's external interface by default even when told 127.0.0.1; setting
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before start-up makes every listener use loopback
(measured, see shared/STACK.md). With an address (``--address`` or ``RAY_ADDRESS``), we
join that cluster and leave its networking alone.
"""
from __future__ import annotations

import logging
import os

import ray

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def keep_ray_on_loopback() -> None:
    """Environment that makes a locally started Ray listen on 127.0.0.1 only."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def start_ray(address: str | None = None, num_cpus: int | None = None, temp_dir: str | None = None) -> None:
    """Join ``address`` (or ``RAY_ADDRESS``) if given, else start an embedded local cluster."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        log.info("joining Ray cluster at %s", address)
        ray.init(address=address, logging_level=logging.WARNING)
        return
    keep_ray_on_loopback()
    kwargs: dict = {
        "node_ip_address": LOOPBACK,
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "log_to_driver": False,
    }
    if num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    if temp_dir is not None:
        kwargs["_temp_dir"] = temp_dir
    log.info("starting embedded Ray on %s", LOOPBACK)
    ray.init(**kwargs)


def gpus_available() -> float:
    """GPUs the running cluster offers (0 on CPU-only machines)."""
    return float(ray.cluster_resources().get("GPU", 0.0)) if ray.is_initialized() else 0.0
