"""What choosing hyperparameters costs when the trials read private data.

A sweep's comparison of trials is itself a release (Papernot & Steinke, ICLR 2022), so three
bounds, each a charge: a free sweep (post-processing of one release), a fixed number of trials
(their composition), and a random number of trials with only the winner published (their Thm 2).
The formulas: docs/privacy.md, "The tuning cost".
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from conclave.errors import InvalidValue
from conclave.privacy.accounting.charge import PrivacyCharge
from conclave.privacy.accounting.guarantee import PLD_THEOREM, worst_case_guarantee
from conclave.privacy.accounting.rdp import sum_charges

METHODS = ("free", "composition", "random-repetition")
STATEMENTS = {
    "free": "post-processing of one DP release (Dwork & Roth 2014, Prop. 2.1): the sweep costs that release once",
    "composition": "adaptive composition of every trial (RDP: Mironov 2017, Prop. 1; extra δ: Dwork & Roth "
    "2014, Thm. 3.16); covers publishing every trial",
    "random-repetition": "best of K ~ truncated negative binomial repetitions (Papernot & Steinke 2022, "
    "Thm. 2); covers publishing the winner only",
}


@dataclass(frozen=True)
class TruncatedNegativeBinomial:
    """The distribution D_{η,γ} of the number of trials (Papernot & Steinke 2022, §3.2)."""

    eta: float
    gamma: float

    def __post_init__(self) -> None:
        if not self.eta > -1:
            raise InvalidValue(f"eta must be > -1, got {self.eta}")
        if not 0 < self.gamma < 1:
            raise InvalidValue(f"gamma must be in (0, 1), got {self.gamma}")

    def expected_trials(self) -> float:
        """E[K], the sweep's expected number of trials."""
        g, eta = self.gamma, self.eta
        if eta == 0:
            return (1 / g - 1) / math.log(1 / g)
        return eta * (1 - g) / (g * (1 - g**eta))

    def pmf(self, k: int) -> float:
        """P[K = k] for k ≥ 1, by the ratio P[k+1]/P[k] = (1 − γ)(k + η)/(k + 1)."""
        if k < 1:
            return 0.0
        g, eta = self.gamma, self.eta
        p = (1 - g) / math.log(1 / g) if eta == 0 else (1 - g) * eta / (g**-eta - 1)
        for j in range(1, k):
            p *= (1 - g) * (j + eta) / (j + 1)
        return p

    def sample(self, rng: np.random.Generator) -> int:
        """One draw of K, by inverting the CDF (works for every η > −1)."""
        u = rng.random()
        g, eta = self.gamma, self.eta
        k = 1
        p = (1 - g) / math.log(1 / g) if eta == 0 else (1 - g) * eta / (g**-eta - 1)
        cumulative = p
        while cumulative < u and p > 0:
            p *= (1 - g) * (k + eta) / (k + 1)
            cumulative += p
            k += 1
        return k


def random_repetition_rdp(orders: np.ndarray, rdp: np.ndarray, distribution: TruncatedNegativeBinomial) -> np.ndarray:
    """RDP of publishing the best of K ~ D_{η,γ} runs of Q (Papernot & Steinke 2022, Thm 2).

    ``rdp`` is Q's RDP curve at ``orders``; the result is ε'(λ) at the same orders, with
    λ̂ chosen per λ as the grid order that minimises the bound.
    """
    orders = np.asarray(orders, dtype=float)
    rdp = np.asarray(rdp, dtype=float)
    eta, gamma = distribution.eta, distribution.gamma
    # The λ̂ terms do not depend on λ: one minimum serves every order.
    selection_terms = (1 + eta) * (1 - 1 / orders) * rdp + (1 + eta) * math.log(1 / gamma) / orders
    best_selection = float(np.min(selection_terms))
    return rdp + best_selection + math.log(distribution.expected_trials()) / (orders - 1)


def random_repetition_charge(
    trial_charges: Sequence[PrivacyCharge], distribution: TruncatedNegativeBinomial, label: str = "sweep"
) -> PrivacyCharge:
    """Charge of publishing only the best of a random-K sweep (Thm 2 above).

    Every trial must carry the same data-independent RDP curve (Q is one algorithm) and no
    δ outside it (Theorem 2 is stated for RDP); otherwise this raises rather than guess.
    """
    if not trial_charges:
        raise InvalidValue("a sweep needs at least one trial's charge")
    first = trial_charges[0]
    for charge in trial_charges:
        if charge.unbounded:
            raise InvalidValue(f"a trial has no finite guarantee ({charge.reason}); no selection bound applies")
        if charge.extra_delta > 0:
            raise InvalidValue("the random-repetition bound needs pure RDP trials "
                             "(a trial spends δ outside its RDP curve)")
        if not (np.array_equal(charge.orders, first.orders) and np.allclose(charge.rdp, first.rdp, rtol=1e-9, atol=0)):
            raise InvalidValue(
                "the random-repetition bound needs every trial to be the same algorithm Q; these trials "
                "differ in privacy cost (a privacy setting was swept): use composition instead"
            )
    rdp = random_repetition_rdp(first.orders, first.rdp, distribution)
    return PrivacyCharge(
        orders=first.orders,
        rdp=rdp,
        label=label,
        details={"trials": len(trial_charges), "eta": distribution.eta, "gamma": distribution.gamma},
    )


@dataclass(frozen=True)
class SweepCost:
    """The (ε, δ) a sweep's published result costs, with the bound that gives it."""

    method: str  # one of METHODS
    epsilon: float
    delta: float
    order: float | None  # the RDP order at which ε was attained (None when not from a curve)
    trials: int
    statement: str  # the theorem, in one line

    @property
    def free(self) -> bool:
        return self.method == "free"


def _to_epsilon(charge: PrivacyCharge, delta: float) -> tuple[float, float | None, str]:
    """(ε, order, theorem) of a charge at total δ, as a run's worst case is: the RDP curve converted at
    what δ is left, or the PLD of its Gaussian plan where every trial carried one and it is
    smaller (order None). The trials' privacy settings come from a data-independent search
    (grid or seeded random), so their plans compose as fixed work."""
    guarantee = worst_case_guarantee(charge, delta)
    return guarantee.epsilon, guarantee.order, guarantee.theorem


def sweep_cost(
    method: str,
    delta: float,
    trial_charges: Sequence[PrivacyCharge] = (),
    release_charge: PrivacyCharge | None = None,
    distribution: TruncatedNegativeBinomial | None = None,
) -> SweepCost:
    """The privacy cost of a whole sweep by ``method``:

    "free"              every trial post-processes one release, whose charge is ``release_charge``;
    "composition"       the sum of every trial's charge (``trial_charges``);
    "random-repetition" Thm 2 above over ``trial_charges`` drawn with ``distribution``.
    """
    if method == "free":
        if release_charge is None:
            raise InvalidValue("a free sweep needs the charge of the one release its trials post-process")
        charge = release_charge
    elif method == "composition":
        if not trial_charges:
            raise InvalidValue("a sweep needs at least one trial's charge")
        charge = sum_charges(list(trial_charges), label="sweep")
    elif method == "random-repetition":
        if distribution is None:
            raise InvalidValue("the random-repetition bound needs the distribution K was drawn from")
        charge = random_repetition_charge(trial_charges, distribution)
    else:
        raise InvalidValue(f"method must be one of {METHODS}, got {method!r}")
    epsilon, order, theorem = _to_epsilon(charge, delta)
    statement = STATEMENTS[method] if theorem != PLD_THEOREM else f"{STATEMENTS[method]}; ε by the {theorem}"
    return SweepCost(method, epsilon, delta, order, len(trial_charges), statement)
