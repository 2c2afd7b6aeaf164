"""A secure round charged and then given up at its deadline, its batch asked again and answered:
the run's privacy report composes every charge at its worst case (the plan covered one batch)."""
from __future__ import annotations

import numpy as np

from conclave.actors.labeller import SecureLabeller, TeachersUnavailable
from conclave.cluster.run_privacy import SECURE_VOTES, PrivacyConfig
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.guarantee import CHARGED_THEOREM, worst_case_guarantee
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.mechanisms.confident_gnmax import SecureConfidentGNMax

DELTA = 1e-5
LEMMA = "test: one record changes one teacher's vote"
QUERIES = 4


class StallsOnce:
    """Secure rounds whose second round of the first batch misses its deadline after being charged."""

    neighbouring = Neighbouring.ADD_REMOVE
    neighbouring_lemma = LEMMA
    batch_coupled, num_classes, local = False, 3, False

    def __init__(self) -> None:
        self.rounds = 0

    def ready(self, timeout: float = 2.0) -> bool:
        return True

    def noised_votes(self, inputs, release, noise, charge) -> np.ndarray:
        charge()  # the round is a release from here on
        self.rounds += 1
        if self.rounds == 2:
            raise TimeoutError("a share missed the round's deadline")
        totals = np.zeros((len(inputs), 3), dtype=np.int64)
        totals[:, 0] = np.where(inputs[:, 0] > 0, 100, 0)  # half the queries confident
        return totals


def test_a_retried_round_is_in_the_published_guarantee():
    mechanism = SecureConfidentGNMax(sigma1=20.0, threshold=50.0, sigma2=10.0)
    planned = mechanism.worst_case_charge(QUERIES).for_records(Neighbouring.ADD_REMOVE, LEMMA)
    inputs = np.array([[1.0], [2.0], [-1.0], [-2.0]], dtype=np.float32)
    with PrivacyLedger(":memory:", DELTA) as ledger:
        labeller = SecureLabeller(StallsOnce(), mechanism, ledger)
        try:
            labeller.label(inputs)
        except TeachersUnavailable:
            pass
        else:
            raise AssertionError("the stalled round answered")
        outcome = labeller.label(inputs)  # the student asks again
        assert not outcome.refused.any()
        report = PrivacyConfig(delta=DELTA).report(planned, ledger, SECURE_VOTES)
        assert ledger.report().charges == 4  # two rounds a try; the second round on the confident half
    plan = worst_case_guarantee(planned, DELTA)
    twice = worst_case_guarantee(planned.scaled(2), DELTA)  # both tries at their worst case
    assert report.planned.epsilon == plan.epsilon
    assert report.guarantee.theorem == CHARGED_THEOREM and report.guarantee.epsilon == twice.epsilon
    assert report.guarantee.epsilon > report.spent.epsilon_spent > plan.epsilon  # the worst case, not the realised
    written = report.as_dict()["planned_worst_case"]
    assert written["covers_the_run"] is False and "charged more than its plan" in written["note"]
    assert "charged more than its plan" in report.headline()
