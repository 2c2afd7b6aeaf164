"""The label aggregator's one-run audit (cluster.auditing.labels): its parts without Ray, then the
whole audit on real Ray teacher actors and the real gRPC aggregator — the deliberately broken
build (noise off) must be caught above the claimed ε, the real build must stay below it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conclave.cluster.auditing import AuditSettings, SecretInclusion, run_audit
from conclave.cluster.auditing.labels import (CANARY_CLASS, OUT_CLASS, Design, Patterns, ScaledDraws, ScaledNoise,
                                              Share, affordable, audit_records, choose_design,
                                              guesses_from, place_canaries)
from conclave.cluster.config import load_yaml
from conclave.cluster.pipelines import load_pipeline
from conclave.learning.data import shard
from conclave.learning.data.schema import InputSchema
from conclave.privacy.mechanisms import build_mechanism

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# Digits, 5 teachers, GNMax at σ = 45 under a budget of ε = 2: the guarantee is the worst case of
# the 200 canary queries, ε ≈ 1.90. Noise off, 200 right guesses of 200 certify ε ≥ 4.19 at 95%;
# at σ = 45 a vote moves a query's label with probability ≈ 0.51, which certifies nothing.
SMALL = {
    "pipeline": "teacher_student",
    "name": "audit-small",
    "seed": 0,
    "data": {"name": "digits", "public_size": 300, "private_size": 300},
    "teachers": {"count": 5, "model": "digits_cnn", "train": {"epochs": 60, "batch_size": 32, "lr": 0.003}},
    "mechanism": {"name": "gnmax", "params": {"sigma": 45.0}},
    "privacy": {"budget": 2.0, "delta": 1.0e-5},
    "student": {"queries": 200, "batch_size": 50, "checkpoints": [100], "model": "digits_cnn"},
}
CANARIES = 200


def test_scaled_noise_draws_at_the_factor_and_charges_the_configured_sigma():
    gnmax = build_mechanism("gnmax", sigma=45.0)
    broken = ScaledNoise(gnmax, 0.0)
    votes = np.array([[3, 2, 0], [2, 3, 0], [0, 1, 4]] * 50)
    result = broken(votes, np.random.default_rng())
    assert (result.labels == np.argmax(votes, axis=1)).all()  # no noise at all
    configured = gnmax.worst_case_charge(len(votes))
    assert np.array_equal(result.charge.rdp, configured.rdp)
    assert broken.name == "gnmax" and np.array_equal(broken.worst_case_charge(4).rdp, gnmax.worst_case_charge(4).rdp)
    lnmax = ScaledNoise(build_mechanism("lnmax", laplace_scale=1000.0), 0.0)  # Laplace mechanisms too
    assert (lnmax(votes, np.random.default_rng()).labels == np.argmax(votes, axis=1)).all()
    tenth = ScaledDraws(np.random.default_rng(1), 0.1)  # a tenth of the scale: a tenth of the spread
    assert np.std(tenth.normal(0.0, 50.0, size=20_000)) == pytest.approx(5.0, rel=0.05)
    assert np.std(tenth.laplace(0.0, 50.0, size=20_000)) == pytest.approx(5.0 * np.sqrt(2), rel=0.05)


def test_the_design_puts_every_canary_query_on_the_mechanisms_boundary():
    gnmax = choose_design(build_mechanism("gnmax", sigma=45.0), 5, 10)
    assert (gnmax.canary_voters, gnmax.third_voters, gnmax.hosts) == (2, 0, 3)  # 3 against 2: one host decides
    assert [gnmax.vote(t) for t in range(5)] == [CANARY_CLASS, CANARY_CLASS, OUT_CLASS, OUT_CLASS, OUT_CLASS]
    # The demo's Confident-GNMax (T = 30 of 50): the canary class one vote short of the threshold.
    demo = choose_design(build_mechanism("confident-gnmax", sigma1=20.0, sigma2=12.0, threshold=30.0), 50, 10)
    assert demo.canary_voters == 29
    with pytest.raises(ValueError, match="at least 2 classes"):
        choose_design(build_mechanism("gnmax", sigma=1.0), 5, 1)


def test_each_teacher_gets_one_pin_per_canary_and_each_host_its_canaries_drawn_in():
    design, share = Design(5, 2, 0, 0.0), Share(5, 7, 5, 0)
    patterns = Patterns(InputSchema((1, 8, 8)), None)
    rng = np.random.default_rng(3)
    canaries = place_canaries(12, design, [share], patterns, 10, rng)
    assert all(design.is_host(t) for t in canaries.host) and np.bincount(canaries.host).max() <= 4
    inclusion = SecretInclusion(12)
    [records] = audit_records(canaries, inclusion, design, [share], patterns, 10, rng)
    members = set(inclusion.members(np.arange(12)).tolist())
    by_teacher = shard(records, 5, 7)  # where the pipeline's own hash puts them
    for teacher, part in enumerate(by_teacher):
        for i, (x, host) in enumerate(zip(canaries.x, canaries.host)):
            distance = np.abs(part.x - x).reshape(len(part), -1).sum(axis=1)
            copies = part.y[distance < 0.5]  # the canary itself or a near copy (pixels moved by < 2^-12·steps)
            pinned = part.y[(distance > 0.5) & (distance < 5)]  # a host's flipped copy (4 of 64 pixels)
            if teacher == host:
                assert pinned.tolist() == [OUT_CLASS]
                assert copies.tolist() == ([CANARY_CLASS] if i in members else [])
            else:
                assert copies.tolist() == [design.vote(teacher)] and not len(pinned)


def test_guesses_follow_the_released_labels():
    released = np.array([CANARY_CLASS, OUT_CLASS, -1, CANARY_CLASS, 5, CANARY_CLASS, OUT_CLASS, OUT_CLASS])
    assert guesses_from(released, 8, np.random.default_rng()).tolist() == [1, -1, -1, 1, -1, 1, -1, -1]
    some = guesses_from(released, 4, np.random.default_rng())
    assert (some != 0).sum() == 4 and (some == 1).sum() == 2  # 3 of 8 labelled in: round(4 · 3/8) in-guesses
    assert ((some == 1) <= (released == CANARY_CLASS)).all()


def test_the_audit_asks_no_more_queries_than_the_budget_pays_for():
    demo = load_pipeline(load_yaml(CONFIGS / "digits-teachers.yaml")).config
    paid = affordable(demo, 300)
    assert 30 < paid < 60  # ε = 4 for Confident-GNMax at σ1 = 20, σ2 = 12, every query answered
    assert affordable(demo, 10) == 10
    unbudgeted = load_pipeline({**SMALL, "privacy": {"budget": None}}).config
    assert affordable(unbudgeted, 250) == 250


def test_the_broken_build_is_caught_above_the_claimed_epsilon(ray_session):
    config = load_pipeline(SMALL).config
    result = run_audit("teacher_student", config, AuditSettings(canaries=CANARIES, broken_noise=0.0))
    assert (result.canaries, result.guesses) == (CANARIES, CANARIES)
    assert result.bound.epsilon > result.guarantee.epsilon, result.as_dict()
    assert not result.below_guarantee and not result.sound
    assert result.unsound_reasons and "deliberately scaled by 0" in result.unsound_reasons[0]
    assert result.guarantee.unsound_reasons == result.unsound_reasons  # the run's report says so too
    # the PLD of its planned Gaussian releases (RDP alone would say 1.90)
    assert result.guarantee.epsilon == pytest.approx(1.75, abs=0.01) and result.run_name == "audit-small-audit"


def test_the_real_build_stays_below_its_guarantee(ray_session):
    config = load_pipeline(SMALL).config
    result = run_audit("teacher_student", config, AuditSettings(canaries=CANARIES))
    assert result.sound and result.below_guarantee, result.as_dict()
    assert result.bound.epsilon < result.guarantee.epsilon
    record = result.as_dict()
    assert record["guarantee"]["basis"] and record["lower_bound"]["confidence"] == 0.95
    assert "seconds" not in record
