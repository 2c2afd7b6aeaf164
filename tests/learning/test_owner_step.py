"""An owner's sparse DP-SGD step at its gateway (``learning.owner_step`` with ``learning.trained_entries``):
noiseless, its clipped gradient sum of the trained entries is the in-cluster masked clipped sum
(``MaskedDPOptimizer``, as ``train_dp`` runs a sparse variant), frozen entries add nothing to an example's
norm, and only the trained entries move between the flat vector of d numbers and the model."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from opacus import GradSampleModule
from torch import nn

from conclave.learning.data import load_digits
from conclave.learning.dpsgd import MaskedDPOptimizer
from conclave.learning.models.resnet import gn_cnn
from conclave.learning.owner_step import OwnerSteps
from conclave.learning.sparse import plan_variant, replace_classifier
from conclave.learning.trained_entries import TrainedEntries

CLIP = 0.05  # below every example's masked norm: each one is clipped


@pytest.fixture(scope="module")
def sparse():
    """A public GroupNorm CNN with a new 5-way classifier, its "all" plan (classifier, GroupNorm and 5% of the
    convolution weights) and 12 private digits."""
    train, _ = load_digits()
    model = replace_classifier(gn_cnn(10, 1, channels=4), 5, seed=1)
    plan = plan_variant(model, "all", fraction=0.05)
    # A copy in plain NCHW strides: load_digits' [n, 1, 8, 8] view has strides torch takes for channels_last,
    # on which Opacus 1.6's hooks (its unfold2d assumes NCHW strides) get every later convolution's
    # per-example gradients wrong; the gateway's torch.func gradients are right either way.
    return model, plan, torch.from_numpy(train.x[:12].copy()), torch.from_numpy(train.y[:12] % 5)


def _gateway_sum(model, plan, x, y) -> tuple[np.ndarray, TrainedEntries]:
    """The owner's step on every record (rate 1) at the model's weights, as its gateway computes it."""
    trained = TrainedEntries.of_masks(model, plan.masks)
    steps = OwnerSteps(copy.deepcopy(model), x.numpy(), y.numpy(), sample_rate=1.0, steps=1, records=len(y),
                       max_grad_norm=CLIP, trained=trained)
    return steps.clipped_sum_at(trained.values(list(model.parameters()))), trained


def test_the_gateways_sparse_sum_is_the_in_cluster_masked_clipped_sum(sparse):
    model, plan, x, y = sparse
    total, trained = _gateway_sum(model, plan, x, y)
    assert trained.dimension == plan.trained_entries == len(total)

    reference = copy.deepcopy(model)
    params = dict(reference.named_parameters())
    wrapped = GradSampleModule(reference, loss_reduction="sum")
    optimizer = MaskedDPOptimizer(torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1),
                                  masks={params[name]: mask for name, mask in plan.masks.items()},
                                  noise_multiplier=0.0, max_grad_norm=CLIP, expected_batch_size=len(y),
                                  loss_reduction="sum")
    nn.functional.cross_entropy(wrapped(x), y, reduction="sum").backward()
    optimizer.clip_and_accumulate()
    sums = [p.summed_grad if p.requires_grad else torch.zeros_like(p) for p in reference.parameters()]
    np.testing.assert_allclose(total, trained.values(sums), rtol=1e-4, atol=1e-7)
    wrapped.to_standard_module()


def test_a_frozen_entry_adds_nothing_to_an_examples_norm(sparse):
    model, plan, x, y = sparse
    alone, _ = _gateway_sum(model, plan, x[:1], y[:1])
    every = TrainedEntries.every(model)  # the same example's gradient, every entry in its norm
    unmasked = OwnerSteps(copy.deepcopy(model), x[:1].numpy(), y[:1].numpy(), 1.0, 1, 1, max_grad_norm=1e9)
    full_norm = np.linalg.norm(unmasked.clipped_sum_at(every.values(list(model.parameters()))))
    # clipped by the trained entries' own norm: exactly C, though the whole gradient's norm is far larger
    assert np.linalg.norm(alone) == pytest.approx(CLIP, rel=1e-4) and full_norm > 10 * CLIP


def test_only_the_trained_entries_travel_and_take_a_gradient(sparse):
    model, plan, _, _ = sparse
    work = copy.deepcopy(model)
    trained = TrainedEntries.of_masks(work, plan.masks)
    parameters = list(work.parameters())
    before = [p.detach().clone() for p in parameters]
    trained.write(parameters, np.zeros(trained.dimension, dtype=np.float32))
    trained.set_gradients(parameters, torch.ones(trained.dimension))
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(parameters, before))
    assert changed <= trained.dimension and sum(int((p.grad != 0).sum()) for p in parameters if p.grad is not None) \
        == trained.dimension
    for (name, p), b in zip(work.named_parameters(), before):
        if not p.requires_grad:
            assert p.grad is None and torch.equal(p.detach(), b), name  # a frozen parameter: untouched
        elif name in plan.masks:
            frozen = plan.masks[name] == 0
            assert torch.equal(p.detach()[frozen], b[frozen]) and (p.grad[frozen] == 0).all(), name
    assert np.array_equal(trained.values(parameters), np.zeros(trained.dimension, dtype=np.float32))


@pytest.mark.parametrize("entries, words", [
    (((99, None),), "strictly increasing indices"),
    (((1, None), (0, None)), "strictly increasing indices"),
    (((0, np.array([0, 10**6])),), "below its"),
    (((0, np.array([3, 3])),), "strictly increasing flat indices"),
    ((), "no parameter trains"),
])
def test_a_mask_past_the_models_shapes_is_refused_in_one_line(sparse, entries, words):
    shapes = tuple(tuple(p.shape) for p in sparse[0].parameters())
    with pytest.raises(ValueError, match=words) as refused:
        TrainedEntries(shapes, entries)
    assert "\n" not in str(refused.value)
