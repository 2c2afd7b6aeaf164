"""Public-cluster votes (``privacy.mechanisms.public_clusters``): one release per batch, charged as
the Gaussian mechanism at ℓ2 √m (checked against dp_accounting and the closed form), or as Cor. 3.6
at Δ₁ = m, Δ₂ = √m through the secure sum; labels are post-processing of that one release."""
from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest

from conclave.privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp
from conclave.privacy.mechanisms import (ABSTAIN, MECHANISMS, PublicClusterVotes, SecurePublicClusterVotes,
                                         build_mechanism, secure_mechanism)

DELTA = 1e-5


@pytest.mark.parametrize("sigma, m", [(20.0, 3), (40.0, 1), (8.0, 5)])
def test_a_batch_costs_one_gaussian_release_at_l2_root_m(sigma, m):
    mechanism = build_mechanism("public-clusters", sigma=sigma, m=m)
    for batch in (1, 300, 1024):  # whatever the batch: parallel composition over its queries
        charge = mechanism.worst_case_charge(batch)
        np.testing.assert_allclose(charge.rdp, DEFAULT_ORDERS * m / (2 * sigma**2), rtol=1e-12)
        assert charge.neighbouring == "add-remove"
    accountant = dp_accounting.rdp.RdpAccountant(list(DEFAULT_ORDERS))
    accountant.compose(dp_accounting.GaussianDpEvent(sigma / math.sqrt(m)))
    ours = epsilon_from_rdp(DEFAULT_ORDERS, mechanism.worst_case_charge(50).rdp, DELTA)[0]
    assert ours == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-6)
    assert mechanism.worst_case_charge(0).is_free
    assert np.allclose(mechanism.run_charge(4, 4).rdp, 4 * mechanism.worst_case_charge(9).rdp)  # one query a batch


def test_the_secure_round_is_corollary_3_6_at_m_and_root_m():
    sigma, m = 20.0, 3
    secure = secure_mechanism(build_mechanism("public-clusters", sigma=sigma, m=m, threshold=5.0, purity=0.5))
    assert secure == SecurePublicClusterVotes(sigma, m, 5.0, 0.5)
    integer = np.arange(2, 40, dtype=float)
    expected = integer * m / (2 * sigma**2) + np.minimum(((2 * integer - 1) * m + 6 * m) / (4 * sigma**4),
                                                         3 * m / (2 * sigma**2))
    charge = secure.worst_case_charge(300)
    at = np.isin(DEFAULT_ORDERS, integer)
    np.testing.assert_allclose(charge.rdp[at], expected[np.isin(integer, DEFAULT_ORDERS)], rtol=1e-12)
    assert secure.vote_bound.round_sensitivity(300) == (3.0, math.sqrt(3))  # per batch, whatever B
    rounds = []
    labels = secure.answer(lambda rows, s: rounds.append((rows, s)) or np.array([[50, 2, 0], [3, 4, 2]]), 2)
    assert labels.tolist() == [0, ABSTAIN] and len(rounds) == 1 and rounds[0][1] == sigma


def test_labels_are_the_confident_argmaxes_of_one_noised_release():
    votes = np.array([[300, 0, 0], [150, 140, 10], [0, 0, 0], [40, 1, 0]])
    clear = PublicClusterVotes(sigma=1e-9, votes_per_record=3, threshold=30.0, purity=0.8)
    result = clear(votes, np.random.default_rng(0))
    assert result.labels.tolist() == [0, ABSTAIN, ABSTAIN, 0]  # impure, empty, then confident
    assert np.allclose(result.charge.rdp, clear.worst_case_charge(4).rdp)
    noisy = PublicClusterVotes(sigma=30.0, votes_per_record=3)
    draws = np.array([noisy(np.array([[200, 180]]), np.random.default_rng(seed)).labels[0] for seed in range(2000)])
    from scipy import stats  # P(argmax = 1) = P(N(0, 2σ²) > 20)
    assert abs((draws == 1).mean() - stats.norm.sf(20 / (30 * math.sqrt(2)))) < 0.03


@pytest.mark.parametrize("params, message", [({"sigma": 0.0, "m": 3}, "sigma"), ({"sigma": 5.0, "m": 0}, "votes_per_record"),
                                             ({"sigma": 5.0, "m": 3, "purity": 1.0}, "purity")])
def test_bad_parameters_are_one_line(params, message):
    with pytest.raises(ValueError, match=message) as refused:
        build_mechanism("public-clusters", **params)
    assert "\n" not in str(refused.value)


def test_registered_with_its_pairing():
    assert MECHANISMS["public-clusters"] is PublicClusterVotes
    assert PublicClusterVotes.paired_with == ("votes_per_record",)
