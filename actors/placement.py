"""Where an owner's actors may run, and a check that some node can take them.

An owner pins its actors to its own node with Ray custom resources the node declares
(``ray start --resources '{"hospital_a": 1}'``) and/or node labels (``--labels owner=a``).
The config's resource amounts are the owner's share of its node: its actors split them
evenly, so ``{hospital_a: 1}`` fits however many actors the owner has.

Ray queues an actor no node can ever take without a word; ``require_node`` looks at the
cluster's nodes first, so a request no node can satisfy is one line naming what is missing.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from conclave.errors import ConclaveError

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 20.0  # how long stopping a run's actors waits for Ray to hand their CPUs back


class PlacementError(ConclaveError, RuntimeError):
    """No node of the cluster can ever take an actor (the message names the missing resource)."""

    exit_code = 2


@dataclass(frozen=True)
class Placement:
    resources: dict[str, float] = field(default_factory=dict)  # custom resources of the owner's node
    labels: dict[str, str] = field(default_factory=dict)  # node labels the owner's node carries

    def __post_init__(self) -> None:
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU", "memory") or not amount > 0 or not math.isfinite(amount):
                raise ValueError(f"resource {name!r}: give custom resources with a positive amount "
                                 f"(CPUs and GPUs are set per actor), got {amount!r}")

    def actor_options(self, num_actors: int) -> dict:
        """Ray ``.options`` for one of ``num_actors`` actors sharing this placement."""
        options: dict = {}
        if self.resources:
            options["resources"] = {name: _share(amount, num_actors) for name, amount in self.resources.items()}
        if self.labels:
            options["label_selector"] = dict(self.labels)
        return options


def _share(amount: float, parts: int) -> float:
    """An even share Ray accepts: fractions below 1 (to 4 decimals, rounded down), whole numbers above."""
    share = amount / parts
    return math.floor(share) if share >= 1 else math.floor(share * 10_000) / 10_000


def cpu_share(cpus: float, parts: int) -> float:
    """``cpus`` split ``parts`` ways, rounded down to hundredths (below 0.01: to Ray's 0.0001): the
    shares never add up to more than ``cpus``, and Ray's messages and ours show 0.33 CPU, not
    0.3333333333333333."""
    share = cpus / parts
    return math.floor(100 * share) / 100 if share >= 0.01 else max(math.floor(10_000 * share) / 10_000, 0.0001)


def require_node(what: str, cpus: float = 0.0, gpus: float = 0.0, resources: dict[str, float] | None = None,
                 labels: dict[str, str] | None = None) -> None:
    """Raise ``PlacementError`` unless some alive node has (in total) what ``what`` asks for."""
    import ray  # here: a config that names a placement loads without Ray

    wanted = {"CPU": cpus, "GPU": gpus, **(resources or {})}
    wanted = {k: v for k, v in wanted.items() if v > 0}
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for node in nodes:
        have, node_labels = node.get("Resources", {}), node.get("Labels", {}) or {}
        if all(have.get(k, 0) >= v for k, v in wanted.items()) and all(
                node_labels.get(k) == v for k, v in (labels or {}).items()):
            return
    need = ", ".join(f"{k}={v:g}" for k, v in wanted.items()) or "nothing"
    if labels:
        need += "; labels " + ", ".join(f"{k}={v}" for k, v in labels.items())
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
