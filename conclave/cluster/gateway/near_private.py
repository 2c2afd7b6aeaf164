"""NearPrivate's two releases through the owners' gateways, after a DP-SGD run's steps.

Admitted with the run (``DpsgdTerms.near_private``): the DP-PCA covariance (round steps + 1) and the
support counts (round steps + 2), each a secure sum over the owners calibrated on both sides from the
same public (ε, δ) (``privacy.pca.SecureAnalyzeGauss``, ``privacy.counts.SkellamCounts``), keyed by
``Keys`` as a step is (the key signs the release's own dimension, scale and multiplier) and charged in
each owner's ledger before its one masked share leaves. The gateway computes its part under the
weights the coordinator sends (a DP checkpoint: public) with ``learning.owner_step.OwnerEmbeddings``.
``NearPrivateReleases`` is what both sides share: which release a round is, its plan and its charge.
"""
from __future__ import annotations

from dataclasses import dataclass

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.counts import SkellamCounts
from conclave.privacy.pca import SecureAnalyzeGauss
from conclave.privacy.secure_sum import SecureSumPlan
from conclave.protos import owner_pb2

PCA, COUNTS = "dp-pca", "support-counts"
ROUNDS_AFTER_STEPS = {1: PCA, 2: COUNTS}  # round steps + 1, steps + 2
OFFSET_OF = {kind: offset for offset, kind in ROUNDS_AFTER_STEPS.items()}
MAX_EPSILON = 100.0  # the most ε one release may be calibrated at


@dataclass(frozen=True)
class NearPrivateReleases:
    """The DP-PCA and support-count releases of one run, calibrated at their (ε, δ)."""

    pca: SecureAnalyzeGauss
    counts: SkellamCounts

    @classmethod
    def of(cls, terms: owner_pb2.NearPrivateTerms) -> NearPrivateReleases:
        """The releases the terms name; ``ValueError`` in one line for numbers outside the protocol's."""
        for name in ("pca_epsilon", "support_epsilon"):
            value = getattr(terms, name)
            if not 0 < value <= MAX_EPSILON:
                raise InvalidValue(f"near_private.{name} must be in (0, {MAX_EPSILON:g}], got {value:g}")
        if not 0 < terms.delta < 1:
            raise InvalidValue(f"near_private.delta must be in (0, 1), got {terms.delta:g}")
        return cls(SecureAnalyzeGauss(terms.pca_epsilon, terms.delta), SkellamCounts(terms.support_epsilon, terms.delta))

    def message(self) -> owner_pb2.NearPrivateTerms:
        return owner_pb2.NearPrivateTerms(pca_epsilon=self.pca.epsilon, support_epsilon=self.counts.epsilon,
                                          delta=self.pca.delta)

    @property
    def charges(self) -> list[PrivacyCharge]:
        return [self.pca.charge(), self.counts.charge()]

    @staticmethod
    def kind(round_: int, steps: int) -> str | None:
        """Which release round ``round_`` of a run of ``steps`` steps is (None: not one of them)."""
        return ROUNDS_AFTER_STEPS.get(round_ - steps)

    def plan(self, kind: str, size: int, parties: tuple[str, ...], records: int) -> SecureSumPlan:
        """The release's secure sum: the covariance of embeddings of width ``size``, or ``size`` counts,
        over ``parties`` holding at most ``records`` records each (public; ``ValueError`` if it cannot fit)."""
        if kind == PCA:
            return self.pca.plan(size, parties, records)
        return self.counts.plan(size, parties, records)

    def release(self, kind: str) -> SecureAnalyzeGauss | SkellamCounts:
        return self.pca if kind == PCA else self.counts
