"""Sparse fine-tuning plans: magnitude masks, the four variants, noise-to-gradient ratios."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from conclave.learning.data import load_digits
from conclave.learning.dp_schedule import DPSGDConfig
from conclave.learning.dpsgd import train_dp
from conclave.learning.models.resnet import gn_cnn, gn_resnet18
from conclave.learning.sparse import (
    VARIANTS,
    magnitude_masks,
    noise_to_gradient_ratio,
    parameter_groups,
    plan_variant,
    replace_classifier,
)
from conclave.privacy.noise import SECURE

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def digits():
    train, _ = load_digits()
    return train.subset(np.arange(400))


def test_parameter_groups_of_the_resnet():
    model = gn_resnet18(10, in_channels=3, width=0.125)
    groups = parameter_groups(model)
    counts = {g: sum(1 for v in groups.values() if v == g) for g in ("conv", "norm", "classifier", "other")}
    # 1 stem + 16 block convs + 3 projection shortcuts; each followed by a GroupNorm (weight, bias).
    assert counts == {"conv": 20, "norm": 40, "classifier": 2, "other": 0}


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.1])
def test_magnitude_mask_keeps_exactly_the_largest_conv_weights(fraction):
    model = gn_resnet18(10, in_channels=3, width=0.125)
    masks = magnitude_masks(model, fraction)
    params = dict(model.named_parameters())
    convs = [n for n, g in parameter_groups(model).items() if g == "conv"]
    total = sum(params[n].numel() for n in convs)
    kept = sum(int(m.sum()) for m in masks.values())
    assert kept == math.ceil(fraction * total)
    smallest_kept = min(float(params[n].detach().abs()[m == 1].min()) for n, m in masks.items())
    largest_dropped = max(
        float(params[n].detach().abs()[masks[n] == 0].max()) if n in masks else float(params[n].detach().abs().max())
        for n in convs
    )
    assert smallest_kept >= largest_dropped
    assert set(masks) <= set(convs)


def test_variants_set_trainable_parameters():
    model = gn_resnet18(10, in_channels=3, width=0.125)
    groups = parameter_groups(model)
    seen = {}
    for variant in VARIANTS:
        plan = plan_variant(model, variant, fraction=0.01)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == set(plan.trainable)
        kinds = {groups[n] for n in trainable}
        seen[variant] = (kinds, plan)
    assert seen["classifier"][0] == {"classifier"}
    assert seen["classifier+norm"][0] == {"classifier", "norm"}
    assert seen["all"][0] == {"classifier", "norm", "conv"}
    assert seen["whole"][1].trained_fraction == 1.0
    all_plan = seen["all"][1]
    extra = all_plan.trained_entries - seen["classifier+norm"][1].trained_entries
    assert extra == sum(int(m.sum()) for m in all_plan.masks.values()) > 0
    assert seen["classifier"][1].trained_entries < seen["classifier+norm"][1].trained_entries < extra + seen[
        "classifier+norm"
    ][1].trained_entries < seen["whole"][1].trained_entries


def training_loss(model: nn.Module, data) -> float:
    model.eval()
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(torch.from_numpy(data.x)), torch.from_numpy(data.y)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_trains_and_keeps_the_rest_frozen(digits, variant):
    torch.manual_seed(0)
    model = replace_classifier(gn_cnn(10, 1, channels=6), 10, seed=1)
    plan = plan_variant(model, variant, fraction=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = DPSGDConfig(
        epochs=4, batch_size=100, lr=0.5, momentum=0.5, noise_multiplier=0.7,
        lr_overrides=(("classifier.", 1.0),),
    )
    loss_before = training_loss(model, digits)
    result = train_dp(model, digits, config, SECURE.source("dpsgd"), masks=plan.masks)
    assert training_loss(result.model, digits) < loss_before - 0.05  # measured here, in the test
    for name, p in result.model.named_parameters():
        if name not in plan.trainable:
            assert torch.equal(p, before[name]), name
        elif name in plan.masks:
            frozen = plan.masks[name] == 0
            assert torch.equal(p[frozen], before[name][frozen]), name


def test_noise_to_gradient_ratio_closed_form(digits):
    # One example with a gradient far above C is clipped to norm C exactly; when only the
    # classifier trains, the ratio is σC√d / C = σ√d.
    model = gn_cnn(10, 1, channels=4)
    plan = plan_variant(model, "classifier")
    x = torch.from_numpy(digits.x[:1]) * 50
    y = torch.from_numpy(digits.y[:1])
    sigma = 3.0
    ratios = noise_to_gradient_ratio(model, x, y, noise_multiplier=sigma, max_grad_norm=1e-4)
    d = sum(p.numel() for n, p in model.named_parameters() if n in plan.trainable)
    assert ratios["groups"] == {"classifier": pytest.approx(sigma * math.sqrt(d), rel=1e-3)}
    assert set(ratios["layers"]) == {"classifier.weight", "classifier.bias"}
    assert all(not hasattr(p, "grad_sample") or p.grad_sample is None for p in model.parameters())


def test_noise_to_gradient_ratio_is_largest_for_convolutions(digits):
    # The paper's Fig. 3 on a whole-network step: noise drowns the conv gradients most.
    torch.manual_seed(0)
    model = gn_cnn(10, 1, channels=8)
    plan_variant(model, "whole")
    x, y = torch.from_numpy(digits.x[:64]), torch.from_numpy(digits.y[:64])
    ratios = noise_to_gradient_ratio(model, x, y, noise_multiplier=1.0, max_grad_norm=1.0)["groups"]
    assert set(ratios) == {"conv", "norm", "classifier"}
    assert ratios["conv"] > ratios["classifier"]
