"""Stability: release the exact plurality only where it is privately shown to be stable.

Bassily, Thakkar & Thakurta (NeurIPS 2018): the distance to instability (sensitivity 1) tested
with the sparse-vector technique of Lyu, Su & Li (VLDB 2017, Alg. 1) and propose-test-release;
the sound version of what NZC hoped for. The run's whole (ε, δ) is charged once, when its first
query is evaluated; state advances only through ``MechanismResult.commit()``. The proof:
docs/privacy.md, "Vote mechanisms".
"""
from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from scipy import optimize

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import Neighbouring, PrivacyCharge
from conclave.privacy.accounting.rdp import approximate_dp_charge
from conclave.privacy.mechanisms.base import ABSTAIN, Description, MechanismResult, VoteMechanism, parameters_of
from conclave.privacy.mechanisms.votes import check_votes


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
    """Pr[ν − ρ ≥ t] for independent ν ~ Lap(query_scale), ρ ~ Lap(threshold_scale)."""
    b1, b2 = query_scale, threshold_scale
    s = abs(t)
    if math.isclose(b1, b2, rel_tol=1e-9):  # the limit of the formula below as b2 → b1
        upper = math.exp(-s / b1) * (2 + s / b1) / 4
    else:
        upper = (b1**2 * math.exp(-s / b1) - b2**2 * math.exp(-s / b2)) / (2 * (b1**2 - b2**2))
    return upper if t >= 0 else 1.0 - upper


@dataclass(frozen=True)
class Calibration:
    """The sparse vector's noise and threshold for a run's (ε, δ, c): the math, apart from the
    mechanism's state."""

    threshold_scale: float  # 1/ε₁, the threshold's Laplace scale
    query_scale: float  # 2c/ε₂, each query's Laplace scale
    threshold: float  # w, in units of distance to instability (about half the vote gap), with c·p₀ ≤ δ

    @property
    def failure_probability(self) -> float:
        """p₀ = Pr[a distance-0 query passes]; the run's failure probability is at most c·p₀ ≤ δ."""
        return laplace_difference_tail(self.threshold, self.query_scale, self.threshold_scale)


@functools.lru_cache(maxsize=256)
def calibrate(epsilon: float, delta: float, max_unstable: int) -> Calibration:
    """The noise scales 1/ε₁ and 2c/ε₂ and the threshold w with c·p₀ ≤ δ for (ε, δ, c)."""
    c = max_unstable
    epsilon1 = epsilon / (1 + (2 * c) ** (2 / 3))
    threshold_scale, query_scale = 1 / epsilon1, 2 * c / (epsilon - epsilon1)
    # log of the p₀ wanted (a 1e-9 margin absorbs rounding); p₀ decreases in w
    target = math.log(delta / c) + math.log1p(-1e-9)

    def excess(w: float) -> float:
        return math.log(laplace_difference_tail(w, query_scale, threshold_scale)) - target

    high = query_scale + threshold_scale
    while excess(high) > 0:
        high *= 2
    threshold = optimize.brentq(excess, 0.0, high, xtol=1e-12)
    while excess(threshold) > 0:  # land on the safe side: p₀ ≤ δ/c
        threshold += 1e-9 * high
    return Calibration(threshold_scale, query_scale, threshold)


@dataclass(frozen=True)
class _State:
    noisy_threshold: float | None = None  # w + ρ, drawn once when the run opens
    unstable: int = 0  # ⊥ answers so far
    queries: int = 0  # queries evaluated so far
    version: int = 0  # bumped by every commit; a commit from an older version is refused


@dataclass(frozen=True)
class Stability(VoteMechanism):
    """(``epsilon``, ``delta``)-DP for the whole run, which stops after ``max_unstable`` ⊥ answers."""

    epsilon: float
    delta: float
    max_unstable: int
    max_queries: int | None = None  # optional cap on queries evaluated (the guarantee does not need it)
    name: ClassVar[str] = "stability"  # not stateless: once its run is open, a batch costs nothing more
    help: ClassVar[dict[str, str]] = {
        "epsilon": "the whole run's epsilon",
        "delta": "the whole run's delta (the test's failure probability)",
        "max_unstable": "c: abstentions after which the run stops answering",
        "max_queries": "optional cap on queries evaluated",
    }
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    # a one-element list: the frozen mechanism's parameters never change, its state does
    _state: list[_State] = field(default_factory=lambda: [_State()], init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise InvalidValue(f"stability: epsilon must be a finite number > 0, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise InvalidValue(f"stability: delta must be in (0, 1), got {self.delta}")
        if self.max_unstable < 1 or (self.max_queries is not None and self.max_queries < 1):
            raise InvalidValue("stability: max_unstable and max_queries must be >= 1")

    @property
    def calibration(self) -> Calibration:
        """The noise scales and threshold for this run's (ε, δ, c)."""
        return calibrate(self.epsilon, self.delta, self.max_unstable)

    # --- state -----------------------------------------------------------------------------

    @property
    def opened(self) -> bool:
        return self._state[0].noisy_threshold is not None

    @property
    def exhausted(self) -> bool:
        state = self._state[0]
        return state.unstable >= self.max_unstable or (self.max_queries is not None and state.queries >= self.max_queries)

    @property
    def unstable_count(self) -> int:
        return self._state[0].unstable

    def __call__(self, votes: np.ndarray, rng: np.random.Generator) -> MechanismResult:
        calibration = self.calibration
        distances = distance_to_instability(votes)
        plurality = np.argmax(check_votes(votes), axis=1)
        labels = np.full(len(distances), ABSTAIN, dtype=np.int64)
        with self._lock:
            start = self._state[0]
        noisy_threshold, unstable, queries = start.noisy_threshold, start.unstable, start.queries
        opens = False
        for row, distance in enumerate(distances):
            if unstable >= self.max_unstable or (self.max_queries is not None and queries >= self.max_queries):
                break
            if noisy_threshold is None:
                noisy_threshold = calibration.threshold + rng.laplace(0.0, calibration.threshold_scale)
                opens = True
            queries += 1
            if distance + rng.laplace(0.0, calibration.query_scale) >= noisy_threshold:
                labels[row] = plurality[row]
            else:
                unstable += 1
        final = _State(noisy_threshold, unstable, queries, start.version + 1)

        def commit() -> None:
            with self._lock:
                if self._state[0].version != start.version:
                    raise RuntimeError("stability: the state moved since this batch was computed; rerun the batch")
                self._state[0] = final

        return MechanismResult(labels, self.run_charge(1, 0) if opens else self._free(), commit)

    def worst_case_charge(self, batch_size: int) -> PrivacyCharge:
        return self._free() if self.opened or batch_size == 0 else self.run_charge(batch_size, batch_size)

    def run_charge(self, asked: int, answered: int) -> PrivacyCharge:
        if asked == 0:
            return self._free()
        return approximate_dp_charge(self.epsilon, self.delta, label=self.name, neighbouring=Neighbouring.ONE_VOTE)

    def _free(self) -> PrivacyCharge:
        return approximate_dp_charge(0.0, 0.0, label=self.name, neighbouring=Neighbouring.ONE_VOTE)

    def describe(self) -> Description:
        return Description(
            self.name, {**parameters_of(self), "threshold": self.calibration.threshold},
            "the exact plurality where distance to instability plus noise passes a noisy threshold, else abstain",
            "Lyu, Su & Li 2017, Alg. 1 (sparse vector, c abstentions) + propose-test-release "
            "(failure ≤ c·p₀ = δ): (ε, δ)-DP for the whole run", bounded=True)
