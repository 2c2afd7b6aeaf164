"""One-run privacy audits of a pipeline as it runs: canaries in, membership guesses out, and
an empirical lower bound on ε to stand beside the guarantee's upper bound.

``run_audit(pipeline, config, settings)`` runs the audit registered for the config's pipeline
on its data plus ``settings.canaries`` canary records (a separate run: canaries never enter a
production run) and returns an ``AuditResult`` (``audit.json``). The bound is
``privacy.accounting.audit.epsilon_lower_bound`` (Steinke, Nasr & Jagielski 2023, Thm 3.1).

Adding an audit for a pipeline is one module with ``audit(config, settings) -> AuditResult``
and one line in ``AUDITS``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from conclave.privacy.accounting.audit import AuditBound
from conclave.privacy.accounting.guarantee import Guarantee
from conclave.privacy.noise import SECURE
from conclave.registry import Registry

# Pipeline name → the module auditing it (each exposes ``audit(config, settings)``).
AUDITS: Registry[Any] = Registry("audited pipeline", {
    "active_learning": "conclave.cluster.auditing.dpsgd",
    "teacher_student": "conclave.cluster.auditing.labels",
})


@dataclass(frozen=True)
class AuditSettings:
    """``canaries``: m, each included with probability ½ (OS entropy; the draw is kept from the
    scorer); ``guesses``: r, the most confident guesses made (None: the audit's own choice);
    ``confidence``: of the lower bound.

    ``broken_noise``: test-only (no CLI flag): scale every DP noise σ the audited run draws by
    this factor while charging and reporting the configured σ — a deliberately broken build
    the audit must catch. Marks the result unsound."""

    canaries: int = 1000
    guesses: int | None = None
    confidence: float = 0.95
    broken_noise: float | None = None


class SecretInclusion:
    """Which of ``count`` canaries are in: independent fair coins from OS entropy. The scorer
    never gets this object; ``correct`` reads it only once the guesses are fixed."""

    def __init__(self, count: int) -> None:
        self._included = SECURE.source("audit-inclusion").rng.integers(0, 2, size=count).astype(bool)

    def members(self, candidates: np.ndarray) -> np.ndarray:
        """The canary numbers among ``candidates`` that are in (for whoever adds them to data)."""
        return candidates[self._included[candidates]]

    def correct(self, guesses: np.ndarray) -> int:
        """How many of the guesses (+1 in, −1 out, 0 abstain) are right."""
        return int(np.sum((guesses != 0) & (guesses == np.where(self._included, 1, -1))))


@dataclass(frozen=True)
class AuditResult:
    """What ``conclave audit`` writes to ``audit.json``: the lower bound beside the guarantee it
    sits under and how it was obtained. Not how long it took: the audit trains on the owners'
    records, so its time grows with them (docs/privacy.md)."""

    pipeline: str
    run_name: str
    bound: AuditBound
    guarantee: Guarantee
    canaries: int
    guesses: int
    correct: int
    method: str  # what was audited and how each canary was scored, one line
    unsound_reasons: tuple[str, ...] = ()

    @property
    def sound(self) -> bool:
        return not self.unsound_reasons and self.guarantee.sound

    @property
    def below_guarantee(self) -> bool:
        return self.bound.epsilon <= self.guarantee.epsilon

    def as_dict(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "run_name": self.run_name,
                "lower_bound": {"epsilon": self.bound.epsilon, "confidence": self.bound.confidence,
                                "delta": self.bound.delta, "theorem": self.bound.theorem},
                "guarantee": self.guarantee.as_dict(), "below_guarantee": self.below_guarantee,
                "canaries": self.canaries, "guesses": self.guesses, "correct": self.correct,
                "method": self.method,
                "sound": self.sound, "unsound_reasons": list(self.unsound_reasons)}


def run_audit(pipeline: str, config: Any, settings: AuditSettings) -> AuditResult:
    """The audit of ``config`` (its pipeline's config) by the module registered for ``pipeline``."""
    return AUDITS.load(pipeline).audit(config, settings)
