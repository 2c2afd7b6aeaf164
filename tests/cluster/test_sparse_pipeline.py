"""The sparse fine-tuning pipeline end to end on digits, and the shipped configs parse."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conclave.cluster.config import ConfigError, from_dict, load_yaml
from conclave.cluster.pipelines import RunContext
from conclave.cluster.api import SparseFinetune
from conclave.cluster.sparse_finetuning import SparseConfig, DataSpec, DPFinetuneConfig, ModelConfig, PretrainConfig
from conclave.cluster.results import RunDirectory
from conclave.cluster.pipelines import load_pipeline
from conclave.learning.dp_schedule import DPSGDConfig
from conclave.learning.train_config import TrainConfig
from conclave.privacy.accounting.rdp import epsilon_from_rdp, sampled_gaussian_rdp

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _pld_epsilon(sample_rate: float, noise_multiplier: float, steps: int, delta: float) -> float:
    """dp_accounting's PLD of ``steps`` Poisson-sampled Gaussian steps, composed as one event."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), steps)
    return pld_privacy_accountant.PLDAccountant().compose(event).get_epsilon(delta)


def test_pipeline_runs_charges_ledger_and_resumes(ray_session, tmp_path):
    config = SparseConfig(
        name="sparse-test",
        model=ModelConfig("gn_cnn", 1, {"channels": 4}),
        public=DataSpec("digits", classes=(0, 1, 2, 3, 4), size=300),
        private=DataSpec("digits", classes=(5, 6, 7, 8, 9), size=300),
        pretrain=PretrainConfig(epochs=2, checkpoint_every=1),
        finetune=DPFinetuneConfig(variants=("classifier", "all"), fraction=0.05, epochs=2, batch_size=60,
                                  target_epsilon=1.0),
    )
    results = RunDirectory(tmp_path, "run")
    summary = SparseFinetune(config).run(RunContext("run", results)).summary
    metrics = json.loads((results.path / "metrics.json").read_text())
    privacy = json.loads((results.path / "privacy.json").read_text())

    assert sorted(p.name for p in (results.path / "checkpoints").iterdir()) == [
        "public-epoch-0001.pt", "public-epoch-0002.pt"]
    assert set(metrics["variants"]) == {"classifier", "all"}
    for variant in metrics["variants"].values():
        assert 0.0 <= variant["accuracy"] <= 1.0
        assert 0.9 <= variant["epsilon"] <= 1.0
    # Two fine-tunings of the same data: the ledger composes two identical sampled-Gaussian
    # runs, i.e. twice the steps, worked out here independently of the pipeline.
    one = metrics["variants"]["all"]
    from conclave.privacy.accounting.rdp import DEFAULT_ORDERS

    rdp = 2 * sampled_gaussian_rdp(DEFAULT_ORDERS, one["sample_rate"], one["noise_multiplier"], one["steps"])
    by_rdp, _ = epsilon_from_rdp(DEFAULT_ORDERS, rdp, 1e-5)
    # both accountings are theorems for a plan fixed in advance; the smaller is published
    expected = min(by_rdp, _pld_epsilon(one["sample_rate"], one["noise_multiplier"], 2 * one["steps"], 1e-5))
    assert privacy["spent"]["charges"] == 2 and privacy["sound"]
    # the planned work is both schedules, fixed before the run: its worst case is the guarantee
    assert privacy["guarantee"]["basis"] == "worst-case"
    assert privacy["guarantee"]["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert privacy["spent"]["epsilon"] == pytest.approx(by_rdp, rel=1e-9)  # the ledger's RDP filter
    assert privacy["guarantee"]["epsilon"] > max(privacy["per_variant_epsilon"].values())
    assert f"ε = {privacy['guarantee']['epsilon']:.3g}" in summary["guarantee (all variants)"]
    assert "losses" not in metrics["variants"]["all"]  # no statistic of the private data
    assert metrics["variants"]["all"]["trained_fraction"] > metrics["variants"]["classifier"]["trained_fraction"]

    # A rerun resumes from the last public checkpoint instead of pre-training again.
    rerun = SparseConfig(**{**config.__dict__, "finetune": DPFinetuneConfig(variants=("classifier",), epochs=1,
                                                                     batch_size=60, target_epsilon=0.5)})
    SparseFinetune(rerun).run(RunContext("run", results))
    again = json.loads((results.path / "metrics.json").read_text())
    assert again["public"]["losses"] == metrics["public"]["losses"]
    assert json.loads((results.path / "privacy.json").read_text())["spent"]["charges"] == 1


@pytest.mark.parametrize("name", ["mnist-sparse.yaml", "cifar-sparse.yaml"])
def test_shipped_configs_parse(name):
    pipeline = load_pipeline(load_yaml(CONFIGS / name))
    assert pipeline.name == "sparse_finetune"
    assert "all" in pipeline.config.finetune.variants


def test_bad_config_names_the_key():
    with pytest.raises(ConfigError, match="variants"):
        from_dict(SparseConfig, {"finetune": {"variants": ["everything"]}})
    with pytest.raises(ConfigError, match="exactly one"):
        from_dict(SparseConfig, {"finetune": {"noise_multiplier": 1.0}})


def test_sections_are_learnings_configs_with_the_runs_delta_and_seed():
    config = from_dict(SparseConfig, {"privacy": {"delta": 1e-6},
                                "pretrain": {"epochs": 2, "optimizer": "sgd", "momentum": 0.9},
                                "finetune": {"lr_overrides": [["features.", 0.01]], "grad_sample_mode": "hooks",
                                             "max_physical_batch_size": 16}})
    assert config.finetune.dp_config(config.privacy.delta) == DPSGDConfig(
        epochs=5, batch_size=128, lr=0.05, momentum=0.9, target_epsilon=1.0, delta=1e-6, grad_sample_mode="hooks",
        lr_overrides=(("classifier.", 0.5), ("features.", 0.01)), max_physical_batch_size=16)
    assert isinstance(config.pretrain, TrainConfig) and config.pretrain.lr == 3e-3
    with pytest.raises(ConfigError, match=r"pretrain: unknown key\(s\) \['seed'\]"):
        from_dict(SparseConfig, {"pretrain": {"seed": 1}})
    with pytest.raises(ConfigError, match=r"finetune: unknown key\(s\) \['delta'\]"):
        from_dict(SparseConfig, {"finetune": {"delta": 1e-6}})
    with pytest.raises(ConfigError, match="classifier_lr sets the classifier's rate"):
        from_dict(SparseConfig, {"finetune": {"lr_overrides": [["classifier.weight", 0.1]]}})
    with pytest.raises(ConfigError, match="masks act on per-example gradients"):
        from_dict(SparseConfig, {"finetune": {"grad_sample_mode": "ghost"}})
