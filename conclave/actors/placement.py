"""How much of the cluster a run's actors take, a check that some node can take them, and their release.

Ray queues an actor no node can ever take without a word; ``require_node`` looks at the
cluster's nodes first, so a request no node can satisfy is one line naming what is missing.
Actors that share the cluster take even CPU shares (``cpu_share``), and a stopped run hands its
CPUs back before it returns (``release``).
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

from conclave.errors import ConclaveError

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 20.0  # how long stopping a run's actors waits for Ray to hand their CPUs back


class PlacementError(ConclaveError, RuntimeError):
    """No node of the cluster can ever take an actor (the message names the missing resource)."""

    exit_code = 2


def cpu_share(cpus: float, parts: int) -> float:
    """``cpus`` split ``parts`` ways, rounded down to hundredths (below 0.01: to Ray's 0.0001): the
    shares never add up to more than ``cpus``, and Ray's messages and ours show 0.33 CPU, not
    0.3333333333333333."""
    share = cpus / parts
    return math.floor(100 * share) / 100 if share >= 0.01 else max(math.floor(10_000 * share) / 10_000, 0.0001)


def require_node(what: str, cpus: float = 0.0, gpus: float = 0.0) -> None:
    """Raise ``PlacementError`` unless some alive node has (in total) the CPUs and GPUs ``what`` asks for."""
    import ray

    wanted = {k: v for k, v in {"CPU": cpus, "GPU": gpus}.items() if v > 0}
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for node in nodes:
        have = node.get("Resources", {})
        if all(have.get(k, 0) >= v for k, v in wanted.items()):
            return
    need = ", ".join(f"{k}={v:g}" for k, v in wanted.items()) or "nothing"
    offered = "; ".join(_offer(n) for n in nodes[:6]) or "no alive nodes"
    raise PlacementError(f"{what}: no node of the cluster has {need} (nodes: {offered})")


def largest_free(resource: str = "CPU") -> float | None:
    """The most of ``resource`` (CPU, GPU) free on any one node now (None if Ray cannot say):
    an actor that asks for no more than this starts at once instead of queueing behind the teachers."""
    try:
        from ray._private.state import available_resources_per_node  # no public per-node view in 2.60
        return max((float(free.get(resource, 0.0)) for free in available_resources_per_node().values()), default=0.0)
    except Exception:  # a private API: if it moves, fall back to waiting with a timeout
        return None


def _offer(node: dict) -> str:
    have = {k: v for k, v in node.get("Resources", {}).items()
            if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(have.items())) or "nothing"


def release(actors: Sequence, cpus_each: float, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
    """Kill ``actors`` and wait until the CPUs they held are free again (at most ``timeout_s``).

    ``ray.kill`` returns at once and Ray hands the CPUs back when the worker is gone: on a
    loaded machine a run that started right after another found them still held for over a
    minute, and failed to place its student. Waiting here makes the next run start clean.
    """
    import ray

    if not actors:
        return
    free_before = ray.available_resources().get("CPU", 0.0)
    for actor in actors:
        ray.kill(actor, no_restart=True)
    expected = min(free_before + cpus_each * len(actors), ray.cluster_resources().get("CPU", 0.0)) - 1e-6
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0.0) < expected:
        if time.monotonic() > deadline:
            log.warning("%d stopped actors' CPUs were not all back after %.0f s", len(actors), timeout_s)
            return
        time.sleep(0.05)
