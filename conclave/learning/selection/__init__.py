"""Active-learning selection strategies: which public points to buy labels for.

Every strategy sees the same thing: a ``PublicPool`` (the DP model's logits and embeddings on
the public points, never their labels) and the label budgets to fill. One call serves all
budgets of one checkpoint, so a strategy that pays privacy (NearPrivate) pays once and the
smaller selections are prefixes of the larger ones where the method allows it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from conclave.errors import InvalidValue
from conclave.registry import Registry


@dataclass(frozen=True)
class PublicPool:
    """What a strategy may look at: model outputs on the unlabeled public points."""

    logits: np.ndarray  # float [n, num_classes]
    embeddings: np.ndarray  # float [n, d], activations before the logits

    def __post_init__(self) -> None:
        if self.logits.ndim != 2 or self.embeddings.ndim != 2:
            raise InvalidValue("logits and embeddings must be 2-D arrays")
        if len(self.logits) != len(self.embeddings):
            raise InvalidValue(f"{len(self.logits)} logits but {len(self.embeddings)} embeddings")

    def __len__(self) -> int:
        return len(self.logits)


class SelectionStrategy(Protocol):
    name: str

    def select(self, pool: PublicPool, sizes: Sequence[int], rng: np.random.Generator) -> dict[int, np.ndarray]:
        """For each budget in ``sizes``, that many distinct indices into ``pool``."""
        ...


def check_sizes(pool: PublicPool, sizes: Sequence[int]) -> list[int]:
    """Budgets sorted ascending; each must be in [1, len(pool)]."""
    sizes = sorted(int(s) for s in sizes)
    if not sizes:
        raise InvalidValue("no label budgets given")
    if sizes[0] < 1 or sizes[-1] > len(pool):
        raise InvalidValue(f"label budgets must be in [1, {len(pool)}] (the public pool), got {sizes}")
    return sizes


STRATEGIES: Registry[type[SelectionStrategy]] = Registry("selection strategy", {
    "random": "conclave.learning.selection.random:RandomSelection",
    "entropy": "conclave.learning.selection.entropy:EntropySelection",
    "margin": "conclave.learning.selection.margin:MarginSelection",
    "diverse_public": "conclave.learning.selection.diverse_public:DiversePublic",
    "near_private": "conclave.learning.selection.near_private:NearPrivate",
})


POOL_ORDER = "pool"
CLUSTERS = "clusters"  # the medoids of round_size clusters of the pool (``learning.selection.clusters``)
COLD_STARTS = ("random", "kmeans")


@dataclass(frozen=True)
class QuerySelection:
    """Which public inputs a student asks the teachers about: ``strategy`` "pool" (the pool in
    order), "clusters" (the medoids of ``round_size`` k-means clusters of the pool in the vote
    source's public embedding, whose labels then label their clusters: public-cluster votes), or a
    strategy above choosing ``round_size`` inputs at a time from a model trained on the answers so
    far. NearPrivate reads private data, so a student cannot use it.

    ``cold_start``: what is asked while fewer than two classes are answered (nothing to train a
    model on): "random" inputs (the pool's first inputs, for "pool"), or "kmeans", the inputs
    nearest ``round_size`` k-means centres of the pool inputs not asked yet, in a PCA embedding
    fitted on the pool (``cold_start.kmeans_cold_start``: typical inputs, one per region), then
    the strategy (for "pool", the rest in pool order).

    ``spread_medoids`` / ``spread_decay`` / ``spread_margin`` ("clusters" only): how answered
    medoids label the pool (``clusters.PoolClusters.spread``): 1, each its own cluster; more, each
    pool input the weighted vote of that many nearest answered medoids, the j-th nearest weighing
    ``spread_decay``^j, where the winner leads by ``spread_margin`` of the weight."""

    strategy: str = POOL_ORDER
    round_size: int = 100
    seed: int = 0  # the random first round, k-means and the strategies' own choices (public data only)
    cold_start: str = "random"
    spread_medoids: int = 1
    spread_decay: float = 1.0
    spread_margin: float = 0.0

    def __post_init__(self) -> None:
        usable = sorted(set(STRATEGIES) - {"near_private"})
        if self.strategy not in (POOL_ORDER, CLUSTERS) and self.strategy not in usable:
            raise InvalidValue(f"selection strategy must be {POOL_ORDER!r}, {CLUSTERS!r} or one of {usable}, got "
                             f"{self.strategy!r}")
        if self.round_size < 1:
            raise InvalidValue(f"round_size must be >= 1, got {self.round_size}")
        if self.cold_start not in COLD_STARTS:
            raise InvalidValue(f"cold_start must be one of {list(COLD_STARTS)}, got {self.cold_start!r}")
        if self.spread_medoids < 1 or not 0 < self.spread_decay <= 1 or not 0 <= self.spread_margin < 1:
            raise InvalidValue(f"spread_medoids must be >= 1, spread_decay in (0, 1] and spread_margin in [0, 1), got "
                             f"{self.spread_medoids}, {self.spread_decay}, {self.spread_margin}")
        if self.spread_margin > 0 and self.spread_medoids == 1:
            raise InvalidValue("spread_margin weighs the votes of several medoids: set spread_medoids above 1")


def build_strategy(name: str, **params: Any) -> SelectionStrategy:
    """The strategy registered as ``name``, built with ``params`` (its dataclass fields)."""
    return STRATEGIES.load(name)(**params)
