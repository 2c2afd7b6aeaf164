"""A run's privacy section and trust model, shared by every pipeline of the library.

``PrivacyConfig`` is the budget declared before the run, δ and where noise comes from; it opens
the run's ledger and states its guarantee. ``TrustModel`` says who sees un-noised values
computed from other parties' records (docs/privacy.md, "Who sees what").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conclave.cluster.config import ConfigError
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.filter import RenyiFilter, filter_for
from conclave.privacy.accounting.guarantee import Guarantee, run_guarantee, worst_case_guarantee
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.noise import NoisePolicy


@dataclass(frozen=True)
class PrivacyConfig:
    """A config's ``privacy`` section: the budget declared before the run, δ, and where noise comes from.

    ``budget``: the ε the run may spend at ``delta``, enforced by the ledger as a Rényi
    filter at an order chosen from the planned work (``privacy.accounting.filter``); null
    for no budget, when the guarantee is the worst case of the planned work alone.
    ``insecure_noise_seed``: reproducible DP noise for debugging — every report of such a
    run says ``sound: false``. Never set it for a result you publish.
    """

    budget: float | None = None
    delta: float = 1e-5
    insecure_noise_seed: int | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and not (self.budget > 0 and math.isfinite(self.budget)):
            raise ValueError(f"privacy.budget must be a finite number > 0 or null, got {self.budget}")
        if not 0 < self.delta < 1:
            raise ValueError(f"privacy.delta must be in (0, 1), got {self.delta}")

    @property
    def noise(self) -> NoisePolicy:
        return NoisePolicy(insecure_seed=self.insecure_noise_seed)

    def require_os_entropy(self, use: str) -> None:
        """Refuse reproducible noise for a ``use`` whose output cannot carry ``sound: false``
        (a served answer; a sweep's winner, whose number of trials the seed would fix)."""
        if self.insecure_noise_seed is not None:
            raise ConfigError(f"privacy.insecure_noise_seed: {use} draws noise from OS entropy only; remove the seed")

    def budget_filter(self, planned: PrivacyCharge) -> RenyiFilter | None:
        """The filter this run declares for its planned worst-case work (None without a budget)."""
        if self.budget is None:
            return None
        try:
            return filter_for(planned, self.budget, self.delta)
        except ValueError as err:
            raise ValueError(f"privacy.budget: {err}") from None

    def open_ledger(self, path: str | Path, planned: PrivacyCharge) -> PrivacyLedger:
        """The run's ledger, its budget (if any) fixed now from ``planned``, before any data is read."""
        return PrivacyLedger(path, self.delta, self.budget_filter(planned), neighbouring=planned.neighbouring)

    def guarantee(self, planned: PrivacyCharge) -> Guarantee:
        """The run's guarantee: the budget or the planned worst case, whichever is smaller."""
        reasons = (self.noise.unsound_reason,) if self.noise.unsound_reason else ()
        return run_guarantee(planned, self.delta, self.budget_filter(planned), reasons)

    def report(self, planned: PrivacyCharge, ledger: PrivacyLedger, trust: TrustModel) -> dict:
        """What every run writes about its privacy: the guarantee, who saw what, then what was
        spent and planned."""
        spent = ledger.report()
        guarantee = self.guarantee(planned)
        return {
            "guarantee": guarantee.as_dict(),
            "sound": guarantee.sound,
            "unsound_reasons": list(guarantee.unsound_reasons),
            "aggregation": trust.aggregation,
            "trust_model": trust.as_dict(),
            "budget": None if spent.budget is None else spent.budget.as_dict(),
            "planned_worst_case": {"epsilon": worst_case_guarantee(planned, self.delta).epsilon,
                                   "charge": planned.label},
            "spent": {"epsilon": spent.epsilon_spent, "order": spent.order, "charges": spent.charges,
                      "by_label": spent.by_label, "rdp_at_budget_order": spent.rdp_at_budget_order,
                      "note": "realised spend: a function of what was released, not the guarantee"},
        }


@dataclass(frozen=True)
class TrustModel:
    """Who sees un-noised values computed from other parties' records in a run (docs/privacy.md,
    "Who sees what"); written to ``privacy.json``. The guarantee holds against everyone else, and
    against these parties only as far as ``statement`` says.

    ``aggregation``: "secure" — every sum across shard actors is a secure sum with distributed
    noise, so whoever sums (and every owner) sees only noised totals (teacher votes too, with
    ``aggregation: secure`` in teacher_student: ``SECURE_VOTES``); "trusted-aggregator" — the
    aggregator sees every teacher's clean vote (PATE's classic trust); "single-holder" — one actor
    holds all the private data, so nothing private crosses between processes but DP releases.
    """

    aggregation: str
    trusted: tuple[str, ...]  # parties that see clean values of data not their own
    statement: str

    def as_dict(self) -> dict[str, Any]:
        return {"aggregation": self.aggregation, "trusted": list(self.trusted), "statement": self.statement}


TRUSTED_AGGREGATOR = TrustModel(
    "trusted-aggregator", ("the aggregator",),
    "the aggregator (in the driver's process) sees every teacher's clean vote on each query; each owner's "
    "actors see only that owner's records and teachers; students and outsiders see released labels only")
SECURE_SUMS = TrustModel(
    "secure", (),
    "owners' shard actors add up clipped gradients (and NearPrivate's sums) only through secure sums: each "
    "sends a masked share with its noise share in it, so whoever sums, and every owner, sees only noised "
    "totals; the driver sees DP releases only")
SECURE_VOTES = TrustModel(
    "secure", (),
    "each owner's teacher actors send only a masked share of their vote histograms with their Skellam noise "
    "share in it, so the aggregator (in the driver's process) sees only noised vote totals and each owner's "
    "actors see only the public inputs; students and outsiders see released labels only")
SINGLE_HOLDER = TrustModel(
    "single-holder", (),
    "one actor holds all the private data and adds the noise itself; nothing computed from the records "
    "leaves it but DP releases")


def dp_sgd_trust(secure: bool) -> TrustModel:
    """The trust model of a DP-SGD run: secure sums across several shard actors, else one holder."""
    return SECURE_SUMS if secure else SINGLE_HOLDER
