"""The privacy report of answering teacher votes: one guarantee, labelled estimates, a public view.

``vote_report`` is what every entry point builds (``conclave analyze``, the teacher/student
pipeline, the benchmarks): the ``Guarantee`` the caller can back with a theorem, the
mechanism's own estimates (the PATE data-dependent analysis, NZC's claim), and — when
parameters fixed in advance are given — the smooth-sensitivity release of the data-dependent
cost, whose own cost the caller must have charged (it is included in ``planned_charge``).

``PrivacyReport.public()`` is what may leave: it drops estimates computed from the private
votes without a mechanism. ``analysis_report`` adds the guarantee for a votes file analysed
offline: the worst case of its queries (every one answered), or the budget that the run which
answered them declared in its ledger — a Rényi filter's guarantee needs the filter in force
while the answers were released, so a budget is never taken from anywhere else; a budget
typed afterwards is only a labelled "would-have-fitted" check. Guarantees are always composed
on the ledger's grid of orders; a custom grid (``orders``) only changes the estimates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting import rdp as rdp_lib
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.filter import filter_for, order_index
from conclave.privacy.accounting.guarantee import Estimate, Guarantee, best, filter_guarantee, worst_case_guarantee
from conclave.privacy.accounting.ledger import LedgerSnapshot
from conclave.privacy.accounting.rdp import sum_charges
from conclave.privacy.accounting.smooth_sensitivity import SmoothSensitivityParameters, release_estimate
from conclave.privacy.mechanisms.base import Description, VoteMechanism
from conclave.privacy.mechanisms.votes import check_answered, check_votes
from conclave.privacy.noise import SECURE, NoisePolicy, NoiseSource

CHECK_LABEL = "check: not a DP guarantee"
NOT_CHECKED = ("that the votes are the histograms this run's teachers produced (the ledger keeps the released "
               "answers, not the votes), that the ledger file is the run's own and unedited, and that the run drew "
               "its noise from OS entropy")


def checked_votes(votes: np.ndarray, answered: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(votes int64 [queries, k], answered bool [queries]) of a non-empty run, or ValueError."""
    array = np.asarray(votes)
    if array.size == 0:
        raise InvalidValue(f"votes is empty (shape {array.shape})")
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


def planned_charge(mechanism: VoteMechanism, queries: int, smooth: SmoothSensitivityParameters | None = None,
                   orders=None, batch_size: int | None = None) -> PrivacyCharge:
    """The worst case of answering ``queries`` queries (all answered), plus the smooth-sensitivity
    release when one is planned: public settings only, so it can fix a filter's order. With
    ``batch_size`` (how the queries are asked) a stateless mechanism is charged batch by batch —
    the same for one charged per query, one release per batch for public-cluster votes."""
    if batch_size and mechanism.stateless and queries:
        full, rest = divmod(queries, batch_size)
        batches = [mechanism.worst_case_charge(batch_size).scaled(full)]
        batches += [mechanism.worst_case_charge(rest)] if rest else []
        charges = [sum_charges(batches, label=mechanism.name)]
    else:
        charges = [mechanism.run_charge(queries, queries)]
    if smooth is not None and mechanism.smooth_sensitivity_analysis:
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
        raise InvalidValue(f"delta must be in (0, 1), got {delta}")
    if conversion not in rdp_lib.CONVERSIONS:
        raise InvalidValue(f"conversion must be one of {rdp_lib.CONVERSIONS}, got {conversion!r}")
    votes, mask = checked_votes(votes, answered)
    grid = rdp_lib.DEFAULT_ORDERS if orders is None else np.asarray(orders, dtype=float)
    estimates = list(mechanism.estimates(votes, mask, delta, grid, conversion))
    if smooth is not None:
        if not mechanism.smooth_sensitivity_analysis:
            estimates.append(Estimate("smooth-sensitivity", None, delta, "PATE 2018, App. C", details={
                "available": False, "reason": f"PATE 2018's smooth-sensitivity analysis does not cover {mechanism.name}"}))
        else:
            if noise is None:
                raise InvalidValue("a smooth-sensitivity release needs a noise source")
            terms = mechanism.smooth_sensitivity_terms(votes, mask, smooth.order)
            estimates.append(release_estimate(terms, smooth, delta, conversion, noise))
    return PrivacyReport(mechanism.describe(), len(votes), int(mask.sum()), int(votes.sum(axis=1).max()),
                         votes.shape[1], guarantee, tuple(estimates), dict(details or {}))


def ledger_checks(ledger: LedgerSnapshot, mechanism: VoteMechanism, queries: int, answered: int) -> list[str]:
    """What ties ``ledger`` to a votes file of ``queries`` queries, ``answered`` of them answered,
    one line per check passed; ValueError naming the first that fails."""
    where = f"ledger {ledger.path}"
    budget = ledger.budget
    if budget is None:
        raise InvalidValue(f"{where} declares no budget (a record-only run): no filter was in force, so it backs "
                         "no guarantee")
    at = order_index(budget.order, ledger.orders)
    spent = ledger.spent
    if spent.unbounded or not budget.admits(float(spent.rdp[at]), spent.extra_delta):
        raise InvalidValue(f"{where} records more than its declared budget: it is not a filter's record")
    expected = mechanism.run_charge(queries, answered)
    charged = ledger.by_label.get(mechanism.name)
    if charged is None:
        raise InvalidValue(f"{where} has no {mechanism.name!r} charges: these votes were not answered by its run")
    same = (np.array_equal(charged.orders, expected.orders)
            and np.allclose(charged.rdp, expected.rdp, rtol=1e-9, atol=0)  # summed per batch: rounding only
            and math.isclose(charged.extra_delta, expected.extra_delta, rel_tol=1e-9))
    if not same:
        raise InvalidValue(f"{where}: its {mechanism.name!r} charges are not what these mechanism settings charge for "
                         f"{queries} queries with {answered} answered (other settings, other votes or another mask)")
    if ledger.answers != queries:
        raise InvalidValue(f"{where} records {ledger.answers} released answers, the votes file has {queries} queries")
    return [
        f"the ledger declares a budget: epsilon={budget.epsilon:g} at delta={budget.delta:g}, order {budget.order:g}",
        f"its charges stay within it (RDP {float(spent.rdp[at]):.4g} of {budget.rdp_budget:.4g} at order "
        f"{budget.order:g})",
        f"its {mechanism.name!r} charges compose to these settings' charge for {queries} queries, {answered} answered",
        f"it records {ledger.answers} released answers, one per query in the file",
    ]


def analysis_report(mechanism: VoteMechanism, votes: np.ndarray, answered: np.ndarray | None, delta: float, *,
                    ledger: LedgerSnapshot | None = None, budget_check: float | None = None,
                    smooth: SmoothSensitivityParameters | None = None, noise: NoisePolicy = SECURE,
                    conversion: str = "tight", orders=None) -> PrivacyReport:
    """``conclave analyze``: the report of a votes file.

    The guarantee is the worst case of the file's queries, every one answered (and the
    smooth-sensitivity release, if made), on the one-vote relation. With ``ledger`` — the
    ledger of the run that answered these votes, which must pass ``ledger_checks`` — it is the
    budget that run declared, enforced by its filter while it answered (on the ledger's
    relation; the better of it and the worst case when that is one-vote too); ``delta`` must
    be the ledger's, and no new smooth-sensitivity release is made (the ledger did not pay for it).

    ``budget_check`` (an ε at ``delta``) only asks whether the filter a run would have declared
    for this workload would have admitted these answers: ``details["budget_check"]``, kind
    "would-have-fitted". It never changes the guarantee: a filter fitted after the answers were
    released was not in force when they were (Feldman & Zrnic 2021, Thm 3.1 needs it declared
    before). Reproducible ``noise`` (for the smooth-sensitivity release) marks the report unsound.
    """
    votes, mask = checked_votes(votes, answered)
    if ledger is not None and delta != ledger.delta:
        raise InvalidValue(f"delta {delta:g} differs from the ledger's {ledger.delta:g}")
    if ledger is not None and smooth is not None:
        raise InvalidValue("a smooth-sensitivity release made now is not paid for by the run's ledger")
    if ledger is not None and budget_check is not None:
        raise InvalidValue("a ledger's declared budget is the guarantee; a would-have-fitted budget check is for votes "
                         "without one")
    planned = planned_charge(mechanism, len(votes), smooth)  # on the ledger's grid, whatever ``orders`` says
    worst = worst_case_guarantee(planned, delta)
    guarantee, details = worst, {}
    if ledger is not None:
        checked = ledger_checks(ledger, mechanism, len(votes), int(mask.sum()))
        declared = filter_guarantee(ledger.budget, ledger.neighbouring)
        guarantee = best(declared, worst) if ledger.neighbouring == worst.neighbouring else declared
        details["ledger"] = {"path": str(ledger.path), "declared": ledger.budget.as_dict(),
                             "neighbouring": ledger.neighbouring.value, "charges": ledger.charges,
                             "answers": ledger.answers, "checked": checked, "not_checked": NOT_CHECKED}
    if budget_check is not None:
        details["budget_check"] = _would_have_fitted(mechanism, mask, planned, budget_check, delta, smooth)
    if smooth is not None and noise.unsound_reason:
        guarantee = guarantee.marked((noise.unsound_reason,))
    return vote_report(mechanism, votes, mask, delta, guarantee, smooth=smooth,
                       noise=noise.source("smooth-sensitivity"), conversion=conversion, orders=orders, details=details)


def _would_have_fitted(mechanism: VoteMechanism, mask: np.ndarray, planned: PrivacyCharge, epsilon: float,
                       delta: float, smooth: SmoothSensitivityParameters | None) -> dict[str, Any]:
    """Whether the filter a run would have declared at ``epsilon`` (its order from ``planned``,
    public settings only) admits the realised data-independent spend. A check, not a guarantee."""
    filter_ = filter_for(planned, epsilon, delta)
    realised = mechanism.run_charge(len(mask), int(mask.sum()))
    at = order_index(filter_.order, realised.orders)
    rdp = float(realised.rdp[at])
    if smooth is not None and mechanism.smooth_sensitivity_analysis:
        rdp += float(smooth.charge(realised.orders).rdp[at])
    fits = filter_.admits(rdp, realised.extra_delta)
    return {
        "kind": "would-have-fitted",
        "label": CHECK_LABEL,
        "statement": (f"a Rényi filter declared before the run at epsilon={epsilon:g}, delta={delta:g}, order "
                      f"{filter_.order:g} would {'have' if fits else 'NOT have'} admitted these answers"),
        "why_not_a_guarantee": "no filter was in force while these answers were released: a budget fitted "
                               "afterwards proves nothing, the guarantee stays the worst case",
        "epsilon": epsilon, "delta": delta, "order": filter_.order, "reserved_delta": filter_.reserved_delta,
        "rdp_budget": filter_.rdp_budget, "realised_rdp_at_order": rdp, "fits": fits,
    }
