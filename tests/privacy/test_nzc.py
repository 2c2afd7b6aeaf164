"""NZC (Sun et al. 2019): its sound figure is unbounded, and an executable counterexample shows
why — two vote histograms one teacher apart whose answers are not ε-close for any finite ε
at the paper's settings (c = 1e100, noise scale 1e10)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from conclave.privacy.accounting.ledger import BudgetExceeded, PrivacyLedger
from conclave.privacy.accounting.filter import RenyiFilter
from conclave.privacy.accounting.report import analysis_report
from conclave.privacy.mechanisms import NZC

PAPER_CONSTANT, PAPER_SCALE = 1e100, 1e10
# 250 teachers, two classes. D: a tie, the plurality is class 0 (lowest index).
# D': one teacher moves from class 0 to class 1, the plurality becomes class 1.
D = np.array([125, 125])
D_PRIME = np.array([124, 126])


def log_tail_laplace_difference(t: float, scale: float) -> float:
    """log P[Z1 − Z0 ≥ t], Z0, Z1 iid Lap(b), t ≥ 0: the density of the difference is
    (1/4b)(1 + |w|/b)e^(−|w|/b), so the tail is (2 + t/b)/4 · e^(−t/b)."""
    return math.log((2 + t / scale) / 4) - t / scale


def log_probabilities_of_class_0(constant: float, scale: float) -> tuple[float, float]:
    """Exact log P[answer 0] on D and on D' for Laplace NZC with two classes."""
    # D: the constant goes to class 0; answer 1 needs Z1 − Z0 > c.
    p_d = -math.expm1(log_tail_laplace_difference(constant, scale))  # 1 − tail
    # D': the constant goes to class 1; answer 0 needs Z0 − Z1 > c + 2.
    log_p_d_prime = log_tail_laplace_difference(constant + 2, scale)
    return math.log(p_d), log_p_d_prime


def test_neighbours_differ_in_one_teacher():
    assert D.sum() == D_PRIME.sum() == 250
    assert np.abs(D - D_PRIME).sum() == 2  # one vote moved between two classes
    assert np.argmax(D) == 0 and np.argmax(D_PRIME) == 1


def test_tail_formula_matches_monte_carlo():
    rng = np.random.default_rng(0)
    diff = rng.laplace(0, 1.0, 400_000) - rng.laplace(0, 1.0, 400_000)
    for t in (0.0, 1.0, 3.0):
        assert (diff >= t).mean() == pytest.approx(math.exp(log_tail_laplace_difference(t, 1.0)), abs=3e-3)


def test_answers_are_not_epsilon_close_at_the_papers_settings():
    log_p, log_p_prime = log_probabilities_of_class_0(PAPER_CONSTANT, PAPER_SCALE)
    # In exact arithmetic: P[answer 0 | D] ≈ 1 while P[answer 0 | D'] = e^(−~1e90), so the
    # privacy loss on the event {answer 0} is ~c/b = 1e90: no ε anyone could publish bounds it.
    privacy_loss = log_p - log_p_prime
    assert log_p == pytest.approx(0.0, abs=1e-12)
    assert privacy_loss > 0.99 * PAPER_CONSTANT / PAPER_SCALE
    claimed = NZC(PAPER_CONSTANT, laplace_scale=PAPER_SCALE).claimed_epsilon(1, 1e-5)
    assert claimed == pytest.approx(2e-10)  # the paper's Theorem 4, per answer
    assert privacy_loss > 1e89  # P[A] > e^ε·P'[A] for every ε ≤ 1e89, vs the claimed 2e-10
    # As floating-point numbers the second probability is exactly zero: P[A] > 0 = P'[A].
    assert math.exp(log_p) > 0.99 and math.exp(log_p_prime) == 0.0

    # And the loss grows without bound as c grows (the paper's c → ∞): no finite ε at all.
    losses = [np.subtract(*log_probabilities_of_class_0(c, PAPER_SCALE)) for c in (1e11, 1e12, 1e20, 1e50)]
    assert all(b > 9 * a for a, b in zip(losses, losses[1:]))


@pytest.mark.parametrize("noise", [{"laplace_scale": PAPER_SCALE}, {"sigma": PAPER_SCALE}])
def test_executed_mechanism_is_deterministic_on_neighbours(noise):
    # The mechanism as run: answers on D are all 0 and on D' all 1 — P[A] = 1, P'[A] = 0.
    mechanism = NZC(PAPER_CONSTANT, **noise)
    on_d = mechanism(np.tile(D, (20_000, 1)), np.random.default_rng(7)).labels
    on_d_prime = mechanism(np.tile(D_PRIME, (20_000, 1)), np.random.default_rng(8)).labels
    assert np.all(on_d == 0) and np.all(on_d_prime == 1)


def test_gaussian_variant_is_no_better():
    # Gaussian NZC on D': answer 0 needs ξ0 − ξ1 > c + 2 with ξ0 − ξ1 ~ N(0, 2σ²).
    log_p_prime = stats.norm.logsf((PAPER_CONSTANT + 2) / (PAPER_SCALE * math.sqrt(2)))
    assert log_p_prime < -1e179


def test_papers_immutability_holds_only_under_the_untested_data_condition():
    # Gap > 2 (the paper's "distance > 2"): neighbours get the same exact answer; that is
    # a property of the private votes, which NZC never checks privately.
    mechanism = NZC(PAPER_CONSTANT, laplace_scale=PAPER_SCALE)
    stable, neighbour = np.array([[130, 120]]), np.array([[129, 121]])
    assert mechanism(stable, np.random.default_rng(0)).labels[0] == mechanism(neighbour, np.random.default_rng(1)).labels[0] == 0


def test_sound_report_is_unbounded_beside_the_claim(tmp_path):
    mechanism = NZC(PAPER_CONSTANT, laplace_scale=PAPER_SCALE)
    charge = mechanism.worst_case_charge(10)
    assert charge.unbounded and np.all(np.isinf(charge.rdp)) and charge.reason
    result = mechanism(np.tile(D, (10, 1)), np.random.default_rng(0))
    assert result.charge.unbounded

    report = analysis_report(mechanism, np.tile(D, (9000, 1)), None, 1e-5).public()
    guarantee = report["guarantee"]
    assert guarantee["epsilon"] == math.inf and guarantee["basis"] == "unbounded" and not report["sound"]
    assert "NZC adds the constant" in report["unsound_reasons"][0]
    (claim,) = report["estimates"]  # the paper's figure, beside the guarantee, labelled
    assert claim["name"] == "paper-claim" and claim["label"] == "estimate: not a DP guarantee"
    assert claim["epsilon_per_query"] == pytest.approx(2e-10)
    assert 0 < claim["epsilon"] < 1e-6 and "NOT a valid DP guarantee" in claim["source"]

    # A ledger with a budget refuses NZC and records nothing; a record-only one shows ε = inf.
    vote = result.charge.for_records("add-remove", "one teacher per record")
    with PrivacyLedger(tmp_path / "finite.db", 1e-5, RenyiFilter(10.0, 1e-5, 32.0)) as ledger:
        with pytest.raises(BudgetExceeded, match="no finite privacy guarantee"):
            ledger.charge(vote)
        assert ledger.report().charges == 0
    with PrivacyLedger(tmp_path / "record.db", 1e-5) as ledger:
        spent = ledger.charge(vote)
        assert spent.epsilon_spent == math.inf and not spent.bounded


def test_claimed_epsilon_composes_as_the_paper_does():
    gamma, queries, delta = 1 / 20.0, 100, 1e-5
    # Dwork–Roth advanced composition of 2γ-DP answers, the paper's (4Tγ² + 2γ·sqrt(2T·log(1/δ)), δ)
    advanced = 4 * queries * gamma**2 + 2 * gamma * math.sqrt(2 * queries * math.log(1 / delta))
    claimed = NZC(1e100, laplace_scale=20.0).claimed_epsilon(queries, delta)
    assert claimed == pytest.approx(min(advanced, 2 * gamma * queries))
    assert NZC(1e100, sigma=40.0).claimed_epsilon(100, delta) > 0
