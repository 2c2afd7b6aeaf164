"""A run config names an owner by its gateway alone: ``{name, gateway}`` beside ``gateways:`` (the
coordinator's certificates), for clusters, kNN or teachers' votes in secure rounds, for DP-SGD active
learning (NearPrivate's releases through the gateways too) and for sparse fine-tuning. Anything else is
refused in one line, before anything starts."""
from __future__ import annotations

import copy

import pytest

from conclave.cluster.config import ConfigError, load_yaml
from conclave.cluster.pipelines import load_pipeline
from tests.conftest import PROJECT_ROOT

GATEWAYS = {"certificate": "coordinator.pem", "key": "coordinator.key", "ca": "ca.pem"}


def gateway_config(name: str = "hospitals-clusters.yaml") -> dict:
    raw = load_yaml(PROJECT_ROOT / "configs" / name)
    raw["owners"] = [{"name": owner["name"], "gateway": f"127.0.0.1:{7001 + i}"} for i, owner in enumerate(raw["owners"])]
    raw["gateways"] = dict(GATEWAYS)
    return raw


def refusal(raw: dict) -> str:
    with pytest.raises(ConfigError) as refused:
        load_pipeline(raw)
    line = str(refused.value)
    assert "\n" not in line
    return line


@pytest.mark.parametrize("name", ["hospitals-clusters.yaml", "hospitals-knn.yaml"])
def test_owners_named_by_their_gateways_load(name):
    config = load_pipeline(gateway_config(name)).config
    assert config.through_gateways and all(owner.data is None for owner in config.owners)


@pytest.mark.parametrize("key, value", [
    ("data", {"format": "csv", "path": "records.csv", "label": "diagnosis"}),
    ("budget", {"epsilon": 20.0}), ("actors", 2), ("records", 100)])
def test_an_owner_entry_mixing_gateway_and_its_own_settings_is_refused_in_one_line(key, value):
    raw = gateway_config()
    raw["owners"][0][key] = value
    line = refusal(raw)
    assert "owners[0]" in line and "hospital_a" in line and f"not {key}" in line


def test_gateway_owners_beside_data_owners_or_without_certificates_are_refused():
    raw, mixed = gateway_config(), load_yaml(PROJECT_ROOT / "configs" / "hospitals-clusters.yaml")
    mixed["owners"][0] = raw["owners"][0]
    mixed["gateways"] = dict(GATEWAYS)
    assert "name every owner one way" in refusal(mixed)
    del raw["gateways"]
    assert "need gateways" in refusal(raw)
    plain = load_yaml(PROJECT_ROOT / "configs" / "hospitals-clusters.yaml")
    plain["gateways"] = dict(GATEWAYS)
    assert "go with owners named by their gateway" in refusal(plain)


def test_gateway_owners_vote_there_in_secure_rounds_only():
    raw = gateway_config()
    trusted = copy.deepcopy(raw)
    del trusted["aggregation"]
    assert load_pipeline(copy.deepcopy(trusted)).config.secure  # left out, with owners: secure
    trusted["aggregation"] = "trusted-aggregator"
    assert "set aggregation: secure, or leave it out" in refusal(trusted)
    raw["clusters"]["embedding"] = "package.module:embed"
    assert "a gateway fits only a registered embedding" in refusal(raw)


@pytest.mark.parametrize("named_by", ["gateway", "data"])
def test_sparse_fine_tuning_through_gateways_loads_with_a_registered_model_and_numbers(named_by):
    """Owners named by their gateway, or by their data (gateways the run starts on this machine): one path."""
    raw = load_yaml(PROJECT_ROOT / "configs" / "mnist-sparse.yaml")
    del raw["private"]
    raw["test"] = {"format": "npz", "path": "test.npz", "label": "y"}
    if named_by == "gateway":
        raw.update(owners=[{"name": f"clinic_{i}", "gateway": f"127.0.0.1:{7001 + i}"} for i in range(2)],
                   gateways=dict(GATEWAYS))
    else:
        raw["owners"] = [{"name": f"clinic_{i}", "data": {"format": "npz", "path": f"clinic_{i}.npz", "label": "y"},
                          "records": 100} for i in range(2)]
    pipeline = load_pipeline(copy.deepcopy(raw))
    assert pipeline.config.through_gateways == (named_by == "gateway") and pipeline.config.secure_training
    assert "finetune.grad_sample_mode" in pipeline.unused_settings()  # a gateway takes its own per-example gradients
    for key, value, said in [("model", {"name": "package.module:factory"}, "trains a registered model"),
                             ("model", {"name": "gn_cnn", "kwargs": {"channels": "16"}}, "numbers only"),
                             ("privacy", {"insecure_noise_seed": 1}, "OS entropy only")]:
        changed = copy.deepcopy(raw)
        changed[key] = value
        assert said in refusal(changed)
    if named_by == "gateway":
        del raw["gateways"]
        assert "need gateways" in refusal(raw)
    else:
        del raw["owners"][1]["records"]
        assert "owner clinic_1: declare its records" in refusal(raw)


def test_dpsgd_active_learning_through_gateways_loads_with_nearprivate_through_secure_sums():
    raw = gateway_config("hospitals-active.yaml")
    config = load_pipeline(copy.deepcopy(raw)).config
    assert config.through_gateways and config.secure_training and all(o.records is None for o in config.owners)
    assert [type(r).__name__ for r in config.selection_releases()] == ["SecureAnalyzeGauss", "SkellamCounts"]
    with pytest.raises(ConfigError, match="plants canaries in the owners' records"):
        load_pipeline(copy.deepcopy(raw)).audit(None)
    for key, value, said in [("checkpoints_from", "results/earlier", "reuse no checkpoints"),
                             ("privacy", {"budget": 6.0, "insecure_noise_seed": 1}, "OS entropy only")]:
        changed = copy.deepcopy(raw)
        changed[key] = value
        assert said in refusal(changed)
    changed = copy.deepcopy(raw)  # the model with the public data, before Ray starts (the registry imports torch)
    changed["model"] = "package.module:factory"
    with pytest.raises(ConfigError, match="trains a registered model"):
        load_pipeline(changed).validate()
    mixed = copy.deepcopy(raw)
    mixed["owners"][0] = load_yaml(PROJECT_ROOT / "configs" / "hospitals-active.yaml")["owners"][0]
    assert "name every owner one way" in refusal(mixed)


def test_teachers_behind_gateways_train_a_registered_model_and_answer_one_sigma(monkeypatch):
    raw = gateway_config("hospitals.yaml")
    config = load_pipeline(copy.deepcopy(raw)).config
    assert config.through_gateways and [owner.teachers for owner in config.owners] == [10, 10, 10]
    changed = copy.deepcopy(raw)
    changed["mechanism"] = {"name": "confident-gnmax", "params": {"sigma1": 20.0, "threshold": 5.0, "sigma": 10.0}}
    assert "sigma1 equal to sigma" in refusal(changed)
    # the model with the models, before Ray starts (the registry imports torch; loading a config does not)
    changed = copy.deepcopy(raw)
    changed["teachers"]["model"] = "package.module:factory"
    monkeypatch.chdir(PROJECT_ROOT)  # the public data's paths are the project root's
    with pytest.raises(ConfigError, match="which train a registered model"):
        load_pipeline(changed).validate()
