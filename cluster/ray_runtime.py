"""Starting or joining Ray, with local traffic kept on loopback.

With no address, ``ray.init()`` starts an embedded single-node cluster. Ray 2.60 binds the
machine's external interface by default. With ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` Ray
takes 127.0.0.1 as the node address and every listener (GCS, raylet, workers, dashboard
agent) binds loopback — measured with ``ss -ltnp``. Ray reads that variable once, when
``ray`` is first imported, so we also set the constant it was read into. With an address (``--address`` or ``RAY_ADDRESS``), we
join that cluster and leave its networking alone.
"""
from __future__ import annotations

import logging
import os

import ray

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def keep_ray_on_loopback() -> None:
    """Make a Ray started from this process (and its children) listen on 127.0.0.1 only."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"  # inherited by Ray's processes
    ray_constants.ENABLE_RAY_CLUSTER = False  # already read at import time in this process


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
