"""Stability: release the exact plurality only where it is privately shown to be stable.

Bassily, Thakkar, Thakurta, "Model-agnostic private learning", NeurIPS 2018 (their
private aggregation algorithm): the sound version of what NZC hoped for. Built from the
sparse-vector technique (Dwork & Roth 2014, §3.6, AboveThreshold, Thm 3.23) and
propose-test-release (Dwork & Roth §7.3 / Dwork & Lei 2009).

Per query, with histogram n sorted as n₍₁₎ ≥ n₍₂₎ and gap g = n₍₁₎ − n₍₂₎:

* distance to instability d = max(0, ⌈g/2⌉ − 1). Changing one teacher moves each sorted
  count by at most 1, so g moves by at most 2 and d by at most 1: **sensitivity 1**. And
  d ≥ 1 means g ≥ 3, so every histogram one teacher away has the same plurality.
* test: d + ν ≥ w + ρ with ν ~ Lap(4/ε′) fresh per query and ρ ~ Lap(2/ε′) the current
  noisy threshold. Pass → release the exact plurality argmax_j n_j. Fail → abstain (⊥);
  that ends the current AboveThreshold instance: a new ρ is drawn, and after
  ``max_unstable`` = c failures the mechanism answers nothing more (it abstains, charging
  nothing; ``exhausted`` turns True). It also stops after ``max_queries`` = m queries.

Guarantee (derivation):

1. Halting at the first ⊥ is AboveThreshold run on the negated queries −d against −w
   (Laplace is symmetric), so each instance is ε′-DP (Dwork & Roth Thm 3.23); the sequence
   of pass/⊥ outcomes of ≤ c instances composes. As RDP each instance is
   (λ, min(ε′, λε′²/2)) (Bun & Steinke 2016, Prop 3.3), c instances add up, and ε′ is the
   largest value whose composed curve converts (Balle et al. 2020, Thm 21) to ≤ ``epsilon``
   at δ/2 (never below ε/c, the basic-composition value).
2. PTR: let E be the event that every passing query had d ≥ 1. On E the released labels
   equal the neighbour's pluralities, so the output is post-processing of the sparse-vector
   outcomes alone. E fails only if some query with d = 0 passes, each with probability at
   most p₀ = Pr[ν − ρ ≥ w] = (b₁²e^(−w/b₁) − b₂²e^(−w/b₂)) / (2(b₁² − b₂²)), b₁ = 4/ε′,
   b₂ = 2/ε′ (the tail of a difference of two Laplaces). The threshold w is set so that
   m·p₀ = δ/2.
3. Hence the whole run of ≤ m queries is (ε, δ)-DP: Pr[M(D) ∈ S] ≤ Pr[¬E] +
   Pr[(SVT(D), pl(D′)) ∈ S] ≤ e^ε Pr[M(D′) ∈ S] + δ/2 + δ/2.

Charges (what the ledger composes, via ``approximate_dp_charge``): a batch pays ε′-DP as
RDP for every instance it evaluates at least one query in (an instance spanning two batches
is paid twice — conservative, and it keeps each batch's charge sound on its own) and p₀
extra δ per query it evaluates. ``worst_case_charge`` bounds both before the batch runs.

State (the cap, the current threshold) lives in one lock-protected object, so concurrent
callers are serialised. The ledger must be checked with ``worst_case_charge`` before the
mechanism runs: a batch that is computed but then refused still advances the state.

Utility note: the threshold w is large (about (4/ε′)·log(m/δ)), so answers need many
teachers in strong agreement; with 250 teachers and ε ≈ 1 nearly everything abstains.
"""
from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from scipy import optimize

from privacy.accounting.charge import PrivacyCharge
from privacy.accounting.rdp import DEFAULT_ORDERS, approximate_dp_charge, epsilon_from_rdp, pure_dp_rdp
from privacy.mechanisms.base import ABSTAIN, MechanismResult
from privacy.mechanisms.votes import check_votes


def distance_to_instability(votes: np.ndarray) -> np.ndarray:
    """d = max(0, ⌈(n₍₁₎ − n₍₂₎)/2⌉ − 1) per row; sensitivity 1 (see module docstring)."""
    counts = check_votes(votes)
    if counts.shape[1] == 1:
        gap = counts[:, 0]
    else:
        top2 = np.sort(counts, axis=1)[:, -2:]
        gap = top2[:, 1] - top2[:, 0]
    return np.maximum(0, (gap + 1) // 2 - 1)


def laplace_difference_tail(t: float, query_scale: float, threshold_scale: float) -> float:
    """Pr[ν − ρ ≥ t] for independent ν ~ Lap(query_scale), ρ ~ Lap(threshold_scale), scales distinct."""
    b1, b2 = query_scale, threshold_scale
    s = abs(t)
    upper = (b1**2 * math.exp(-s / b1) - b2**2 * math.exp(-s / b2)) / (2 * (b1**2 - b2**2))
    return upper if t >= 0 else 1.0 - upper


def composed_epsilon(instance_epsilon: float, instances: int, delta: float) -> float:
    """ε at ``delta`` of ``instances`` ε′-DP sparse-vector instances composed as RDP."""
    rdp = instances * pure_dp_rdp(DEFAULT_ORDERS, instance_epsilon)
    return epsilon_from_rdp(DEFAULT_ORDERS, rdp, delta)[0]


@functools.lru_cache(maxsize=256)
def _calibrate(epsilon: float, delta: float, max_unstable: int, max_queries: int) -> tuple[float, float]:
    """(ε′, w): the per-instance ε and the threshold meeting the (ε, δ) of the docstring."""
    basic = epsilon / max_unstable  # basic composition: c·ε′ = ε with no δ at all
    if composed_epsilon(epsilon, max_unstable, delta / 2) <= epsilon:
        instance_epsilon = epsilon
    elif composed_epsilon(basic, max_unstable, delta / 2) > epsilon:
        instance_epsilon = basic
    else:
        root = optimize.brentq(
            lambda e: composed_epsilon(e, max_unstable, delta / 2) - epsilon, basic, epsilon, xtol=1e-12
        )
        while composed_epsilon(root, max_unstable, delta / 2) > epsilon:  # brentq may land a hair above
            root *= 1 - 1e-9
        instance_epsilon = max(root, basic)

    query_scale, threshold_scale = 4.0 / instance_epsilon, 2.0 / instance_epsilon
    # log of the p₀ wanted (a 1e-9 margin absorbs rounding); p₀ decreases in w
    target = math.log(delta / 2 / max_queries) + math.log1p(-1e-9)

    def excess(w: float) -> float:
        return math.log(laplace_difference_tail(w, query_scale, threshold_scale)) - target

    high = query_scale
    while excess(high) > 0:
        high *= 2
    threshold = optimize.brentq(excess, 0.0, high, xtol=1e-12)
    while excess(threshold) > 0:  # land on the safe side: p₀ ≤ δ/(2m)
        threshold += 1e-9 * high
    return instance_epsilon, threshold


@dataclass
class _SparseVectorState:
    lock: threading.Lock = field(default_factory=threading.Lock)
    noisy_threshold: float | None = None  # ρ of the open instance; None before the first query
    unstable: int = 0  # ⊥ answers so far (closed instances)
    queries: int = 0  # queries evaluated so far


@dataclass(frozen=True)
class Stability:
    """(``epsilon``, ``delta``)-DP over at most ``max_queries`` queries and ``max_unstable`` ⊥s."""

    epsilon: float
    delta: float
    max_unstable: int
    max_queries: int = 10_000
    name: ClassVar[str] = "stability"
    _state: _SparseVectorState = field(default_factory=_SparseVectorState, init=False, repr=False, compare=False)
    # Derived in __post_init__: ε′ per instance, the Laplace scales 4/ε′ and 2/ε′, the
    # threshold w and p₀ = Pr[a distance-0 query passes].
    instance_epsilon: float = field(init=False, repr=False, compare=False, default=0.0)
    query_scale: float = field(init=False, repr=False, compare=False, default=0.0)
    threshold_scale: float = field(init=False, repr=False, compare=False, default=0.0)
    threshold: float = field(init=False, repr=False, compare=False, default=0.0)
    failure_probability: float = field(init=False, repr=False, compare=False, default=0.0)

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"stability: epsilon must be a finite number > 0, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise ValueError(f"stability: delta must be in (0, 1), got {self.delta}")
        if self.max_unstable < 1 or self.max_queries < 1:
            raise ValueError("stability: max_unstable and max_queries must be >= 1")
        instance_epsilon, threshold = _calibrate(self.epsilon, self.delta, self.max_unstable, self.max_queries)
        object.__setattr__(self, "instance_epsilon", instance_epsilon)
        object.__setattr__(self, "query_scale", 4.0 / instance_epsilon)
        object.__setattr__(self, "threshold_scale", 2.0 / instance_epsilon)
        object.__setattr__(self, "threshold", threshold)
        object.__setattr__(
            self, "failure_probability", laplace_difference_tail(threshold, self.query_scale, self.threshold_scale)
        )

    def guarantee(self) -> tuple[float, float]:
        """The stated (ε, δ) for the whole run (module docstring, steps 1–3)."""
        return self.epsilon, self.delta

    @property
    def exhausted(self) -> bool:
        state = self._state
        return state.unstable >= self.max_unstable or state.queries >= self.max_queries

    @property
    def unstable_count(self) -> int:
        return self._state.unstable

    def __call__(self, votes: np.ndarray, rng: np.random.Generator) -> MechanismResult:
        distances = distance_to_instability(votes)
        plurality = np.argmax(check_votes(votes), axis=1)
        labels = np.full(len(distances), ABSTAIN, dtype=np.int64)
        state = self._state
        with state.lock:
            instances = 0  # instances that evaluate at least one query of this batch
            evaluated = 0
            opens_instance = True
            for row, distance in enumerate(distances):
                if state.unstable >= self.max_unstable or state.queries >= self.max_queries:
                    break
                if state.noisy_threshold is None:
                    state.noisy_threshold = self.threshold + rng.laplace(0.0, self.threshold_scale)
                instances += opens_instance
                opens_instance = False
                evaluated += 1
                state.queries += 1
                if distance + rng.laplace(0.0, self.query_scale) >= state.noisy_threshold:
                    labels[row] = plurality[row]
                else:
                    state.unstable += 1
                    state.noisy_threshold = None  # the next query opens a fresh instance
                    opens_instance = True
        return MechanismResult(labels, self._charge(instances, evaluated))

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        state = self._state
        with state.lock:
            instances = min(batch_size, self.max_unstable - state.unstable)
            evaluated = min(batch_size, self.max_queries - state.queries)
        return self._charge(max(instances, 0), max(evaluated, 0))

    def _charge(self, instances: int, evaluated: int) -> PrivacyCharge:
        return approximate_dp_charge(
            self.instance_epsilon, evaluated * self.failure_probability, label=self.name, count=instances
        )
