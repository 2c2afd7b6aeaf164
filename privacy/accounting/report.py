"""The privacy report of answering teacher votes: one guarantee, labelled estimates, a public view.

``vote_report`` is what every entry point builds (``conclave analyze``, the teacher/student
pipeline, the benchmarks): the ``Guarantee`` the caller can back with a theorem, the
mechanism's own estimates (the PATE data-dependent analysis, NZC's claim), and — when
parameters fixed in advance are given — the smooth-sensitivity release of the data-dependent
cost, whose own cost the caller must have charged (it is included in ``planned_charge``).

``PrivacyReport.public()`` is what may leave: it drops estimates computed from the private
votes without a mechanism. ``analysis_report`` adds the guarantee for a votes file analysed
offline: the worst case of its queries (every one answered), or with a budget the filter's.
Guarantees are always composed on the ledger's grid of orders; a custom grid (``orders``)
only changes the estimates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from privacy.accounting import rdp as rdp_lib
from privacy.accounting.charge import ONE_VOTE, PrivacyCharge
from privacy.accounting.filter import filter_for, order_index
from privacy.accounting.guarantee import Estimate, Guarantee, best, filter_guarantee, worst_case_guarantee
from privacy.accounting.rdp import sum_charges
from privacy.accounting.smooth_sensitivity import SmoothSensitivityParameters, release_estimate
from privacy.mechanisms.base import Description, VoteMechanism
from privacy.mechanisms.votes import check_answered, check_votes
from privacy.noise import SECURE, NoisePolicy, NoiseSource


def checked_votes(votes: np.ndarray, answered: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(votes int64 [queries, k], answered bool [queries]) of a non-empty run, or ValueError."""
    array = np.asarray(votes)
    if array.size == 0:
        raise ValueError(f"votes is empty (shape {array.shape})")
    checked = check_votes(array)
    return checked, check_answered(answered, len(checked))


@dataclass(frozen=True)
class PrivacyReport:
    """What answering ``queries`` vote histograms cost, and what of it may be published."""

    mechanism: Description
    queries: int
    answered: int
    teachers: int
    classes: int
    guarantee: Guarantee
    estimates: tuple[Estimate, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)  # e.g. the budget and whether the run fits it

    @property
    def sound(self) -> bool:
        return self.guarantee.sound

    def estimate(self, name: str) -> Estimate | None:
        return next((e for e in self.estimates if e.name == name), None)

    def as_dict(self, include_private: bool = True) -> dict[str, Any]:
        """Everything, for the data holder (``include_private``), or only what may be published."""
        return {
            "mechanism": self.mechanism.as_dict(),
            "queries": self.queries,
            "answered": self.answered,
            "teachers": self.teachers,
            "classes": self.classes,
            "sound": self.sound,
            "unsound_reasons": list(self.guarantee.unsound_reasons),
            "guarantee": self.guarantee.as_dict(),
            "estimates": [e.as_dict() for e in self.estimates if include_private or not e.private],
            **self.details,
        }

    def public(self) -> dict[str, Any]:
        return self.as_dict(include_private=False)


def planned_charge(mechanism: VoteMechanism, queries: int,
                   smooth: SmoothSensitivityParameters | None = None, orders=None) -> PrivacyCharge:
    """The worst case of answering ``queries`` queries (all answered), plus the smooth-sensitivity
    release when one is planned: public settings only, so it can fix a filter's order."""
    charges = [mechanism.run_charge(queries, queries)]
    if smooth is not None and hasattr(mechanism, "smooth_sensitivity_terms"):
        charges.append(smooth.charge(charges[0].orders if orders is None else np.asarray(orders, dtype=float)))
    return sum_charges(charges, label="planned")


def vote_report(mechanism: VoteMechanism, votes: np.ndarray, answered: np.ndarray | None, delta: float,
                guarantee: Guarantee, *, smooth: SmoothSensitivityParameters | None = None,
                noise: NoiseSource | None = None, conversion: str = "tight", orders=None,
                details: dict[str, Any] | None = None) -> PrivacyReport:
    """The report of answering ``votes`` (``answered`` marks the released answers; all if None).

    ``guarantee`` comes from the caller, who knows the run's budget and planned work. With
    ``smooth`` the data-dependent cost is released by GNSS with those fixed parameters,
    drawing on ``noise`` (whose soundness the caller folds into ``guarantee``).
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if conversion not in rdp_lib.CONVERSIONS:
        raise ValueError(f"conversion must be one of {rdp_lib.CONVERSIONS}, got {conversion!r}")
    votes, mask = checked_votes(votes, answered)
    grid = rdp_lib.DEFAULT_ORDERS if orders is None else np.asarray(orders, dtype=float)
    estimates = list(mechanism.estimates(votes, mask, delta, grid, conversion))
    if smooth is not None:
        if not hasattr(mechanism, "smooth_sensitivity_terms"):
            estimates.append(Estimate("smooth-sensitivity", None, delta, "PATE 2018, App. C", details={
                "available": False, "reason": f"PATE 2018's smooth-sensitivity analysis does not cover {mechanism.name}"}))
        else:
            if noise is None:
                raise ValueError("a smooth-sensitivity release needs a noise source")
            terms = mechanism.smooth_sensitivity_terms(votes, mask, smooth.order)
            estimates.append(release_estimate(terms, smooth, delta, conversion, noise))
    return PrivacyReport(mechanism.describe(), len(votes), int(mask.sum()), int(votes.sum(axis=1).max()),
                         votes.shape[1], guarantee, tuple(estimates), dict(details or {}))


def analysis_report(mechanism: VoteMechanism, votes: np.ndarray, answered: np.ndarray | None, delta: float, *,
                    budget: float | None = None, smooth: SmoothSensitivityParameters | None = None,
                    noise: NoisePolicy = SECURE, conversion: str = "tight", orders=None) -> PrivacyReport:
    """``conclave analyze``: the report of a votes file, on the one-vote neighbouring relation.

    Without ``budget`` the guarantee is the worst case of the file's queries, every one
    answered (and the smooth-sensitivity release, if made). With ``budget`` (an ε at
    ``delta``) the filter a run would have declared for this workload is built; when the
    realised data-independent spend fits it, the guarantee is the better of the filter's and
    the worst case, and ``details.budget.fits`` says whether it did. Reproducible ``noise``
    (for the smooth-sensitivity release) marks the report unsound.
    """
    votes, mask = checked_votes(votes, answered)
    planned = planned_charge(mechanism, len(votes), smooth)  # on the ledger's grid, whatever ``orders`` says
    worst = worst_case_guarantee(planned, delta)
    guarantee, details = worst, {}
    if budget is not None:
        filter_ = filter_for(planned, budget, delta)
        realised = mechanism.run_charge(len(votes), int(mask.sum()))
        at = order_index(filter_.order, realised.orders)
        extra = realised.extra_delta
        rdp = float(realised.rdp[at])
        if smooth is not None and hasattr(mechanism, "smooth_sensitivity_terms"):
            rdp += float(smooth.charge(realised.orders).rdp[at])
        fits = filter_.admits(rdp, extra)
        details["budget"] = {**filter_.as_dict(), "realised_rdp_at_order": rdp, "fits": fits}
        guarantee = best(filter_guarantee(filter_, ONE_VOTE), worst) if fits else worst
    if smooth is not None and noise.unsound_reason:
        guarantee = guarantee.marked((noise.unsound_reason,))
    return vote_report(mechanism, votes, mask, delta, guarantee, smooth=smooth,
                       noise=noise.source("smooth-sensitivity"), conversion=conversion, orders=orders, details=details)
