"""A tiny sweep of each kind on digits, through Ray Tune on the session's Ray: each writes its
table and plot, names its best trial, and reports the sweep's ε including the tuning, which
is checked against its formula from the trials' own DP-SGD schedules."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from cluster.config import ConfigError, from_dict, load_yaml
from privacy.accounting.rdp import DEFAULT_ORDERS, epsilon_from_rdp, sampled_gaussian_rdp
from privacy.accounting.tuning_cost import TruncatedNegativeBinomial, random_repetition_rdp
from tuning.config import TuneConfig
from tuning.sweep import check, run_sweep, summary_lines

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _config(name: str, **changes) -> TuneConfig:
    """A shipped configs/tune-digits-*.yaml, shrunk for the test by dotted-key changes."""
    raw = load_yaml(CONFIGS / name)
    for dotted, value in changes.items():
        node = raw
        *parents, leaf = dotted.split("/")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return from_dict(TuneConfig, raw)


def _read(summary: dict) -> tuple[dict, list[dict]]:
    path = Path(summary["path"])
    assert (path / "accuracy_vs_epsilon.png").stat().st_size > 10_000
    with (path / "trials.csv").open() as f:
        rows = list(csv.DictReader(f))
    return json.loads((path / "sweep.json").read_text()), rows


def _sparse_trial_rdp(noise_multiplier: float, examples: int, batch: int, epochs: int) -> np.ndarray:
    steps_per_epoch = math.ceil(examples / batch)
    return sampled_gaussian_rdp(DEFAULT_ORDERS, 1 / steps_per_epoch, noise_multiplier, epochs * steps_per_epoch)


def _digits_5_to_9_train_size() -> int:
    from cluster.pipelines.sparse_finetune import DataSpec, load_split

    return len(load_split(DataSpec("digits", classes=(5, 6, 7, 8, 9)), 0)[0])


def test_sparsity_sweep_with_asha_composes_every_trial(ray_session, tmp_path):
    config = _config("tune-digits-sparsity.yaml", **{
        "base/pretrain/epochs": 1, "base/finetune/epochs": 2,
        "space": {"finetune.variants": {"grid": [["classifier"], ["all"]]}},
    })
    summary = run_sweep(config, tmp_path, verbose=0)
    sweep, rows = _read(summary)
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    assert {r["finetune.variants"] for r in rows} == {"classifier", "all"}
    best = sweep["best"]
    assert best["accuracy"] == pytest.approx(max(float(r["accuracy"]) for r in rows), abs=1e-4)
    assert best["accuracy"] > 0.3  # 5 classes: chance is 0.2
    assert best["epsilon_trial"] <= 1.0 + 1e-6  # the ε target of each trial
    # Two trials with the same DP-SGD schedule: RDP twice the trial's, converted at δ.
    sigma = float(rows[0]["noise_multiplier"])
    trial = _sparse_trial_rdp(sigma, _digits_5_to_9_train_size(), 128, 2)
    expected, _ = epsilon_from_rdp(DEFAULT_ORDERS, 2 * trial, 1e-5)
    assert sweep["tuning_cost"]["method"] == "composition" and not sweep["tuning_cost"]["free"]
    assert best["epsilon_with_tuning"] == pytest.approx(expected, rel=1e-9)
    assert best["epsilon_with_tuning"] > best["epsilon_trial"]
    assert any("including the tuning" in line for line in summary_lines(summary))


def test_sparsity_sweep_with_a_random_number_of_trials_uses_theorem_2(ray_session, tmp_path, caplog):
    config = _config("tune-digits-sparsity.yaml", **{
        "base/pretrain/epochs": 1, "base/finetune/epochs": 1, "scheduler": {"name": "fifo"},
        "cost": {"method": "random-repetition", "eta": 1.0, "gamma": 0.5}, "seed": 3,
        "space": {"finetune.fraction": {"uniform": [0.01, 0.2]}},
    })
    caplog.set_level("DEBUG")
    summary = run_sweep(config, tmp_path, verbose=0)
    sweep, rows = _read(summary)
    # Only the winner is published, and the number of trials K appears in no output:
    # not in the table, not in sweep.json, not in the summary, not as Tune's trial folders.
    assert len(rows) == 1 and sweep["best"]["trial_id"] == rows[0]["trial_id"]
    assert sweep["trials"] is None and sweep["failed"] is None and "num_samples" not in sweep
    assert set(sweep["repetitions"]) == {"eta", "gamma", "expected_trials", "published"}
    assert not (Path(summary["path"]) / "ray").exists()
    assert "only the winner published" in summary_lines(summary)[0]
    assert not any("K =" in record.getMessage() or "trials drawn" in record.getMessage() for record in caplog.records)
    trial = _sparse_trial_rdp(float(rows[0]["noise_multiplier"]), _digits_5_to_9_train_size(), 128, 1)
    bound = random_repetition_rdp(DEFAULT_ORDERS, trial, TruncatedNegativeBinomial(1.0, 0.5))
    assert sweep["tuning_cost"]["method"] == "random-repetition"
    assert "Thm. 2" in sweep["tuning_cost"]["statement"]
    assert sweep["best"]["epsilon_with_tuning"] == pytest.approx(epsilon_from_rdp(DEFAULT_ORDERS, bound, 1e-5)[0],
                                                                 rel=1e-9)


def test_diverse_public_sweep_is_free_post_processing_of_one_checkpoint(ray_session, tmp_path):
    config = _config("tune-digits-diverse.yaml", **{
        "base/dpsgd/epochs": 2, "base/finetune/epochs": 3,
        "space": {"selection.n_cluster": {"grid": [5, 10]}, "selection.n_each": {"grid": [3]}},
    })
    summary = run_sweep(config, tmp_path, verbose=0)
    sweep, rows = _read(summary)
    assert sorted(int(r["n_labeled"]) for r in rows) == [15, 30]
    release = sweep["release"]
    assert sweep["tuning_cost"]["free"] and sweep["tuning_cost"]["method"] == "free"
    # The sweep costs the checkpoint once: its ledger's ε, whatever the number of trials.
    assert sweep["best"]["epsilon_with_tuning"] == pytest.approx(release["epsilon"], rel=1e-12)
    assert all(float(r["epsilon"]) == pytest.approx(release["epsilon"], abs=1e-4) for r in rows)
    assert Path(release["path"]).is_file()


def test_near_private_sweep_splits_the_epsilon_limit_on_the_simplex(ray_session, tmp_path):
    # One trial keeps the test fast (each runs the whole pipeline); composing several is
    # checked by the sparsity sweeps above.
    config = _config("tune-digits-nearprivate.yaml", **{
        "num_samples": 1, "base/data/num_shards": 1,
        "base/dpsgd/epochs": 2, "base/selection/near_private_epoch": 2,
        "base/finetune/epochs": 3, "space/selection.sizes": {"choice": [[20]]},
    })
    summary = run_sweep(config, tmp_path, verbose=0)
    sweep, rows = _read(summary)
    (row,) = rows
    assert row["status"] == "ok" and row["stage"] == "near_private" and int(row["n_labeled"]) == 20
    shares = [float(row[k]) for k in ("dpsgd.target_epsilon", "selection.epsilon_pca", "selection.epsilon_support")]
    assert sum(shares) == pytest.approx(3.0, abs=1e-5) and min(shares) >= 0.1 - 1e-5
    # the trial composes its three releases in RDP: at most their basic-composition sum
    assert 0 < float(row["epsilon"]) <= 3.0
    # one trial: the sweep's ε is its run ledger's, the same as the pipeline's per-model figure
    assert sweep["tuning_cost"]["method"] == "composition"
    assert sweep["best"]["epsilon_with_tuning"] == pytest.approx(float(row["epsilon"]), abs=1e-4)


def test_teacher_ensemble_sweep_runs_the_pipeline_per_trial(ray_session, tmp_path):
    # One trial keeps the test fast (it trains an ensemble and a student); composing several
    # is checked by the sparsity sweeps above.
    config = _config("tune-digits-teachers.yaml", **{
        "num_samples": 1, "base/teachers/per_actor": 4,  # one teacher actor
        "base/teachers/train/epochs": 3, "base/student/train/epochs": 3,
        "base/student/checkpoints": [20],
        # σ's low enough to answer with 4 teachers, high enough that the worst case of one
        # batch of 40 queries stays under the ε limit of 20 (else the ledger refuses it)
        "space": {"teachers.count": {"choice": [4]}, "mechanism.params.threshold_fraction": {"choice": [0.5]},
                  "mechanism.params.sigma1": {"choice": [4.0]}, "mechanism.params.sigma2": {"choice": [5.0]},
                  "student.queries": {"choice": [40]}},
    })
    summary = run_sweep(config, tmp_path, verbose=0)
    sweep, rows = _read(summary)
    (row,) = rows
    assert row["status"] == "ok" and int(row["teachers.count"]) == 4 and int(row["asked"]) == 40
    assert 0 < int(row["answered"]) <= 40
    assert 0 < float(row["epsilon"]) <= 20.0  # under the ledger's limit
    # one trial: the sweep's ε is the trial's ledger (its planned worst case composed in RDP)
    assert sweep["best"]["epsilon_with_tuning"] <= float(row["epsilon"]) + 1e-4


@pytest.mark.parametrize("changes,message", [
    ({"scheduler": {"name": "asha"}}, "asha needs trials that report every epoch"),
    ({"cost": {"method": "random-repetition"}}, "charges differ"),
    ({"space": {"teachers.cuont": {"choice": [4]}}}, "unknown key"),
    ({"base/pipeline": "sparse_finetune"}, "runs the 'teacher_student' pipeline"),
])
def test_teacher_sweeps_refuse_what_their_trials_cannot_do(changes, message):
    with pytest.raises(ConfigError, match=message):
        check(_config("tune-digits-teachers.yaml", **changes))


@pytest.mark.parametrize("changes,message", [
    ({"cost": {"method": "random-repetition"}}, "no grid"),
    ({"cost": {"method": "random-repetition"}, "scheduler": {"name": "fifo"},
      "space": {"finetune.target_epsilon": {"choice": [0.5, 1.0]}}}, "same privacy cost"),
    ({"space": {"pretrain.epochs": {"choice": [1, 2]}}}, "prepared once"),
])
def test_sparsity_sweeps_refuse_unsound_random_repetition_and_swept_fixed_keys(changes, message):
    with pytest.raises(ConfigError, match=message):
        check(_config("tune-digits-sparsity.yaml", **changes))


def test_diverse_public_sweeps_refuse_sweeping_what_the_checkpoint_was_trained_with():
    with pytest.raises(ConfigError, match=r"\['privacy.delta'\] are prepared once"):
        check(_config("tune-digits-diverse.yaml", **{"space/privacy.delta": {"choice": [1e-5, 1e-6]}}))


def test_conclave_tune_rejects_a_bad_config_with_status_2(tmp_path, capsys):
    from cluster.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "tune-digits-teachers.yaml").read_text().replace("kind: teacher_ensemble",
                                                                                 "kind: ensemble"))
    assert main(["tune", str(bad), "--results-dir", str(tmp_path)]) == 2
    assert "kind" in capsys.readouterr().err
