"""The one-run audit of active_learning's DP-SGD, on real actors and real Opacus: the real build's
bound stays below its guarantee, a build with its noise switched off is caught above it, and
``conclave audit`` writes audit.json (or refuses in one line)."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conclave.cluster import cli
from conclave.cluster.auditing import AuditSettings, SecretInclusion, run_audit
from conclave.cluster.auditing.dpsgd import (CanaryRecords, CanarySource, default_guesses, guesses_from,
                                             make_canaries, membership_scores)
from conclave.cluster.pipelines import load_pipeline
from conclave.learning.data import Dataset, load_digits
from conclave.learning.dp_schedule import DPSGDConfig
from conclave.learning.dpsgd import train_dp
from conclave.learning.models import build_model
from conclave.privacy.noise import BROKEN_REASON, NoisePolicy

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONFIGS = PROJECT_ROOT / "configs"

# Small enough for two cores, strong enough for the broken build to be caught: 300 private digits
# and 200 canaries (the schedule's N = 500), claimed ε = 1. Without noise, 100 epochs at lr 1 and
# batch 32 memorise the canaries: the 100 guesses are (nearly) all right, a bound of 2.7–3.5, far
# above the claimed 1 (81 of 100 right are enough). With the noise on, the guesses are a coin's.
TINY = {"pipeline": "active_learning", "name": "tiny", "model": "digits_cnn",
        "data": {"name": "digits", "private_size": 300, "num_shards": 1},
        "dpsgd": {"epochs": 100, "batch_size": 32, "lr": 1.0, "noise_multiplier": None, "target_epsilon": 1.0},
        "selection": {"strategies": ["random"], "sizes": [10]}}
CANARIES, GUESSES = 200, 100


def tiny_config(**dpsgd):
    raw = {**TINY, "dpsgd": {**TINY["dpsgd"], **dpsgd}}
    return raw, load_pipeline(raw).config


def test_the_real_build_stays_below_its_guarantee_and_a_noiseless_one_is_caught_above_it(ray_session):
    _, config = tiny_config()
    real = run_audit("active_learning", config, AuditSettings(canaries=CANARIES, guesses=GUESSES))
    broken = run_audit("active_learning", config,
                       AuditSettings(canaries=CANARIES, guesses=GUESSES, broken_noise=0.0))
    # Both claim the same guarantee: the schedule of 300 + 200 declared records at the configured σ.
    assert real.guarantee.epsilon == pytest.approx(broken.guarantee.epsilon) and real.guarantee.epsilon <= 1.0
    assert real.guarantee.basis == "worst-case" and real.guarantee.delta == 1e-5
    assert (real.canaries, real.guesses, broken.guesses) == (CANARIES, GUESSES, GUESSES)

    assert real.below_guarantee and real.bound.epsilon <= real.guarantee.epsilon, real
    assert real.sound and real.unsound_reasons == () and real.run_name == "tiny-audit"

    assert broken.bound.epsilon > broken.guarantee.epsilon, broken
    assert not broken.below_guarantee and not broken.sound
    reason = BROKEN_REASON.format(scale=0.0)
    assert broken.unsound_reasons == (reason,) and broken.guarantee.unsound_reasons == (reason,)
    assert broken.as_dict()["guarantee"]["sound"] is False


def test_conclave_audit_writes_audit_json_and_prints_one_line(ray_session, tmp_path, capsys):
    raw, _ = tiny_config(epochs=2)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    code = cli.main(["audit", str(path), "--canaries", "40", "--guesses", "10", "--results-dir", str(tmp_path),
                     "--run-name", "cli"])
    captured = capsys.readouterr()
    out = captured.out.strip().splitlines()
    assert code == 0, captured.err[-2000:]
    audit = json.loads((tmp_path / "cli-audit" / "audit.json").read_text())
    assert {"pipeline", "run_name", "lower_bound", "guarantee", "below_guarantee", "canaries", "guesses", "correct",
            "method", "sound", "unsound_reasons"} <= set(audit)
    assert "seconds" not in audit  # the audit trains on the owners' records: its time grows with them
    assert audit["pipeline"] == "active_learning" and audit["run_name"] == "cli-audit"
    assert (audit["canaries"], audit["guesses"]) == (40, 10) and 0 <= audit["correct"] <= 10
    assert audit["lower_bound"]["confidence"] == 0.95 and audit["lower_bound"]["delta"] == 1e-5
    assert audit["sound"]
    assert audit["below_guarantee"] or audit["correct"] == 10  # the audit's own false alarm: < 1e-3 here
    assert out == [f"audit: ε ≥ {audit['lower_bound']['epsilon']:.3f} at 95% (m=40, r=10, v={audit['correct']}) "
                   f"under guarantee ε = {audit['guarantee']['epsilon']:.3f}"]
    assert not list(tmp_path.glob("cli/*")) and not list(tmp_path.glob("**/ledger.sqlite"))  # no ledger kept


@pytest.mark.parametrize("argv,message", [
    (["audit", str(CONFIGS / "mnist-sparse.yaml")], r"'sparse_finetune' has no audit; audited pipelines: "),
    (["audit", str(CONFIGS / "digits-active.yaml"), "--canaries", "10", "--guesses", "11"], r"--guesses must be in"),
    (["audit", str(CONFIGS / "digits-active.yaml"), "--confidence", "1"], r"--confidence must be in \(0, 1\)"),
    (["audit", "nowhere.yaml"], r"config file not found"),
    (["audit", str(CONFIGS / "hospitals-active.yaml")], r"plants canaries in the owners' records, which stay "
                                                        r"behind their gateways"),
    (["audit", str(CONFIGS / "hospitals.yaml")], r"plants canaries in the teachers' records, which owners keep "
                                                 r"behind their gateways"),
])
def test_what_the_audit_cannot_take_is_one_line_and_status_2(argv, message, tmp_path, capsys):
    assert cli.main([*argv, "--results-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert re.search(message, captured.err), captured.err
    assert not any(tmp_path.iterdir())


def test_a_secure_sum_config_refuses_the_broken_switch_before_anything_starts():
    _, config = tiny_config(distributed=True)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, num_shards=2))  # two shard actors
    assert config.secure_training
    with pytest.raises(ValueError, match="secure sum"):
        run_audit("active_learning", config, AuditSettings(canaries=10, broken_noise=0.1))


def test_canaries_guesses_and_the_inclusion_draw():
    _, test = load_digits()
    canaries = make_canaries(test, 300, np.random.default_rng(0))
    assert canaries.x.shape == (300, 1, 8, 8) and canaries.x.dtype == np.float32
    assert 0.0 <= canaries.x.min() and canaries.x.max() <= 1.0 and set(np.unique(canaries.y)) == set(range(10))
    flat = test.x.reshape(len(test), -1)
    assert not any((flat == row).all(axis=1).any() for row in canaries.x.reshape(300, -1))  # no real record

    scores = np.array([0.5, -3.0, 2.0, 0.0, -1.0])
    assert guesses_from(scores, 2).tolist() == [0, -1, 1, 0, 0]
    assert guesses_from(scores, 3).tolist() == [1, -1, 1, 0, 0]
    assert guesses_from(scores, 5).tolist() == [1, -1, 1, 1, -1]
    assert [default_guesses(m) for m in (1, 3, 20, 1000)] == [1, 2, 4, 200]

    inclusion = SecretInclusion(400)
    members = CanaryRecords(np.zeros((400, 2), np.float32), np.arange(400)).subset(inclusion.members(np.arange(400)))
    assert 100 < len(members) < 300  # fair coins (fails with probability < 1e-20)
    truth = np.where(np.isin(np.arange(400), members.y), 1, -1)
    assert inclusion.correct(truth) == 400 and inclusion.correct(-truth) == 0
    assert inclusion.correct(np.zeros(400, dtype=np.int64)) == 0


def test_the_canaries_join_the_holders_data_and_are_scored_by_their_loss():
    class Held:
        owner = "digits (private split)"

        def load(self, shard_ids):
            return Dataset(np.zeros((3, 1, 8, 8), np.float32), np.array([1, 2, 3]), 10, "held")

    canaries = CanaryRecords(np.ones((2, 1, 8, 8), np.float32), np.array([4, 5]))
    data = CanarySource(Held(), canaries).load([0])
    assert data.y.tolist() == [1, 2, 3, 4, 5] and data.x[3:].min() == 1.0 and CanarySource(Held(), canaries).owner

    model = build_model("digits_cnn", 10, 1, seed=0, input_size=8)
    scores = membership_scores(model, canaries)
    with torch.no_grad():
        expected = -torch.nn.functional.cross_entropy(model(torch.ones(2, 1, 8, 8)), torch.tensor([4, 5]),
                                                      reduction="none")
    assert scores == pytest.approx(expected.numpy(), rel=1e-5)


def test_the_broken_switch_draws_other_noise_but_accounts_and_charges_the_configured_sigma():
    train, _ = load_digits()
    data = Dataset(train.x[:64], train.y[:64], 10, "few")
    config = DPSGDConfig(epochs=2, batch_size=16, lr=0.5, noise_multiplier=1.0, grad_sample_mode="hooks")
    results = {}
    for scale in (1.0, 0.0):
        policy = NoisePolicy(insecure_seed=3, noise_scale=scale)  # replayable: the same batches both times
        model = build_model("digits_cnn", 10, 1, seed=0, input_size=8)
        results[scale] = (train_dp(model, data, config, policy.source("dpsgd")),
                          torch.cat([p.detach().flatten() for p in model.parameters()]))
    (honest, honest_weights), (broken, broken_weights) = results[1.0], results[0.0]
    assert broken.epsilons == honest.epsilons and broken.noise_multiplier == honest.noise_multiplier == 1.0
    assert broken.charge.rdp.tolist() == honest.charge.rdp.tolist()
    assert not torch.allclose(broken_weights, honest_weights)

    assert NoisePolicy().sound and not NoisePolicy(noise_scale=0.1).sound
    assert NoisePolicy(noise_scale=0.1).unsound_reason == BROKEN_REASON.format(scale=0.1)
    both = NoisePolicy(insecure_seed=1, noise_scale=0.0).unsound_reason
    assert "insecure_noise_seed=1" in both and "scaled by 0" in both
    with pytest.raises(ValueError, match="noise_scale"):
        NoisePolicy(noise_scale=-1.0)
    assert dataclasses.replace(NoisePolicy(), noise_scale=0.5).source("x").noise_scale == 0.5
