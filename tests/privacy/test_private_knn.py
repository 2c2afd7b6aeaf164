"""Private-kNN's screening and argmax over Poisson-sampled kNN votes, and its record-level charge."""
from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp
from conclave.privacy.mechanisms import ABSTAIN, MECHANISMS
from conclave.privacy.mechanisms.private_knn import PrivateKnnMechanism

INTEGER = np.array([float(o).is_integer() for o in DEFAULT_ORDERS])


def _per_query_by_dp_accounting(q: float, sigma1: float, sigma2: float) -> np.ndarray:
    """One query, independently: the screening (Δ = 1) and argmax (Δ₂ = √2) on one sample are one
    Gaussian release of the whitened pair, sampled at q."""
    z = 1 / math.sqrt((1 / sigma1) ** 2 + (math.sqrt(2) / sigma2) ** 2)
    accountant = RdpAccountant(orders=[float(o) for o in DEFAULT_ORDERS])
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), 1)
    return np.asarray(accountant._rdp, dtype=float)


@pytest.mark.parametrize("q", [0.05, 0.1])
def test_charge_per_query_is_the_sampled_gaussian_of_dp_accounting(q):
    mechanism = PrivateKnnMechanism(sigma1=75.0, threshold=180.0, sigma2=25.0, sample_rate=q)
    charge = mechanism.worst_case_charge(1000)
    assert charge.neighbouring == Neighbouring.ADD_REMOVE  # records vote directly: no teacher-level restatement
    np.testing.assert_allclose(charge.rdp[INTEGER], 1000 * _per_query_by_dp_accounting(q, 75.0, 25.0)[INTEGER],
                               rtol=1e-6)
    # The paper's MNIST settings at 1,000 queries stay under ε = 0.5 at δ = 1e-5 with q = 0.05.
    if q == 0.05:
        assert epsilon_from_rdp(DEFAULT_ORDERS, charge.rdp, 1e-5)[0] < 0.5


def test_abstains_below_the_threshold():
    mechanism = PrivateKnnMechanism(sigma1=1000.0, threshold=1e6, sigma2=1.0, sample_rate=0.1)
    votes = np.array([[300, 0, 0], [0, 150, 150]] * 50)
    result = mechanism(votes, np.random.default_rng(0))
    assert np.all(result.labels == ABSTAIN)
    # The charge never depends on how many were answered: the steps share each query's sample.
    np.testing.assert_array_equal(result.charge.rdp, mechanism.worst_case_charge(len(votes)).rdp)


def test_answers_the_argmax_of_a_clear_histogram():
    mechanism = PrivateKnnMechanism(sigma1=1.0, threshold=100.0, sigma2=1.0, sample_rate=0.1)
    votes = np.array([[0, 300, 0, 0], [0, 0, 0, 250], [200, 10, 0, 0]])
    assert mechanism(votes, np.random.default_rng(0)).labels.tolist() == [1, 3, 0]


def test_worst_case_bounds_every_run_charge():
    mechanism = PrivateKnnMechanism(sigma1=40.0, threshold=80.0, sigma2=15.0, sample_rate=0.1)
    worst = mechanism.worst_case_charge(20).rdp
    for answered in (0, 7, 20):
        assert np.all(mechanism.run_charge(20, answered).rdp <= worst)
    assert mechanism.run_charge(0, 0).is_free
    with pytest.raises(ValueError, match="answered must be in"):
        mechanism.run_charge(3, 4)


def test_registered_and_described():
    # Selectable by name; configs and the aggregator pair it with kNN votes only (tests/cluster/test_knn_pipeline.py).
    assert MECHANISMS["private-knn"] is PrivateKnnMechanism
    mechanism = PrivateKnnMechanism(sigma1=75.0, threshold=180.0, sigma2=25.0, sample_rate=0.05)
    description = mechanism.describe()
    assert description.name == "private-knn" and description.bounded
    assert description.parameters == {"sigma1": 75.0, "threshold": 180.0, "sigma2": 25.0, "sample_rate": 0.05}
    assert "Mironov, Talwar & Zhang 2019" in description.analysis and "Poisson sample" in description.releases
    assert set(mechanism.help) == set(description.parameters)
    assert mechanism.estimates(np.zeros((1, 2), dtype=int), np.ones(1, bool), 1e-5, DEFAULT_ORDERS, "tight") == []


@pytest.mark.parametrize("params, message", [({"sample_rate": 0.0}, "sample_rate"), ({"sigma1": 0.0}, "sigma1"),
                                             ({"threshold": math.inf}, "threshold")])
def test_bad_parameters_are_one_line(params, message):
    with pytest.raises(ValueError, match=message):
        PrivateKnnMechanism(**{"sigma1": 75.0, "threshold": 180.0, "sigma2": 25.0, "sample_rate": 0.05, **params})
