"""DP-SGD across owners through the secure sum: owner A's rank, curious, replays the attack that
worked on Opacus's plaintext all-reduce (recover B's clipped sum, then B's record from a
linear model's gradient) and holds only B's sum under noise of the planned variance."""
from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

from conclave.learning.secure_dpsgd import PaddedPoissonBatches, padded_batch_size
from tests.learning.curious_owner import RECORD_B, run_rank
from tests.learning.ranks import run_ranks


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_curious_owner_holds_only_the_noised_total_of_the_other_owners_clipped_sums(tmp_path):
    run_ranks(run_rank, (_free_port(), str(tmp_path)))
    a, b = np.load(tmp_path / "rank0.npz"), np.load(tmp_path / "rank1.npz")
    modulus, scale, variance = int(a["modulus"]), float(a["scale"]), float(a["noise_variance"])
    steps = len(a["total"])
    assert steps == 8 * 5 and len(b["quantized"]) == steps

    # The masks cancel exactly: the total is both owners' quantized sums plus both noise shares.
    total = a["total"] & (modulus - 1)
    total = np.where(total >= modulus // 2, total - modulus, total)
    np.testing.assert_array_equal(total, a["quantized"] + b["quantized"] + a["noise"] + b["noise"])
    np.testing.assert_array_equal(a["total"], b["total"])

    # What A can do: subtract its own sum and its own noise from the total it received.
    estimate = total - a["quantized"] - a["noise"]
    residual = estimate - b["quantized"]
    np.testing.assert_array_equal(residual, b["noise"])  # B's noise share, and nothing else
    assert 0.7 < residual.std() / np.sqrt(variance) < 1.3  # of the planned variance (2 owners: μ each)

    # Recovering B's record x = dW[j]/db[j] from a step whose batch held it: exact from the clean
    # sum a plaintext all-reduce gave away, noise from what A holds now.
    weights, bias = slice(0, 6), slice(6, 8)  # the Linear layer's entries: weight [2, 3], bias [2]
    sampled = [s for s in range(steps) if np.any(b["quantized"][s] != 0)]
    assert sampled  # at rate 1/5 over 40 steps, B's record is sampled about 8 times (never: p = 1e-4)
    for step in sampled:
        clean = b["quantized"][step] / scale
        if abs(clean[bias][0]) >= 0.2:  # rounding to 1/γ = 1/64 blurs the ratio when db is small
            np.testing.assert_allclose(clean[weights].reshape(2, 3)[0] / clean[bias][0], RECORD_B[0], atol=0.1)
    errors = []
    for step in sampled:
        noisy = estimate[step] / scale
        guess = noisy[weights].reshape(2, 3)[0] / noisy[bias][0]
        errors.append(np.linalg.norm(guess - RECORD_B[0]) / np.linalg.norm(RECORD_B[0]))
    assert np.median(errors) > 0.5

    # Both owners compute every step on batches of one public size, though A holds 40 records and
    # B one: when each reaches the all-reduce does not follow its secret Poisson batch.
    assert len(a["rows"]) == len(b["rows"]) == steps
    assert set(a["rows"].tolist()) == set(b["rows"].tolist()) == {padded_batch_size(41, 1 / 5)}

    # What each rank sends is uniform on the ring whatever its value.
    shares = np.concatenate([a["share"].ravel(), b["share"].ravel()]).astype(np.float64) / modulus
    assert 0 <= shares.min() and shares.max() < 1 and abs(shares.mean() - 0.5) < 0.1


@pytest.mark.parametrize("max_rows", [None, 7])
def test_every_step_computes_on_the_same_padded_shape_whatever_the_rank_holds(max_rows):
    shapes, states = set(), set()
    for held in (0, 1, 40):
        generator = torch.Generator().manual_seed(5)
        x, y = torch.randn(held, 3), torch.arange(held) % 2
        batches = PaddedPoissonBatches(x, y, 0.2, steps=30, records=41, generator=generator, max_rows=max_rows)
        for chunks in batches:
            shapes.add(tuple((tuple(cx.shape), tuple(cy.shape), tuple(w.shape)) for cx, cy, w in chunks))
            weight = torch.cat([w for _, _, w in chunks])
            rows = torch.cat([cx for cx, _, _ in chunks])[weight == 1]
            assert len(rows) <= held and len({tuple(r.tolist()) for r in rows}) == len(rows)  # held, distinct
            assert torch.all(weight[int(weight.sum()):] == 0)  # the sampled examples first, then padding
        states.add(generator.get_state().numpy().tobytes())  # as many draws for 0, 1 or 40 held
    padded = padded_batch_size(41, 0.2)
    rows = min(padded, max_rows or padded)
    assert shapes == {tuple(((rows, 3), (rows,), (rows,)) for _ in range(-(-padded // rows)))}
    assert len(states) == 1


def test_a_batch_past_the_padded_size_takes_more_chunks_and_keeps_every_example():
    # Only an owner holding more than it declared (or a draw of probability <= OVERFLOW) gets here.
    batches = PaddedPoissonBatches(torch.randn(40, 3), torch.zeros(40, dtype=torch.long), 1.0, steps=1,
                                   records=5, generator=torch.Generator().manual_seed(0))
    [chunks] = list(batches)
    assert sum(int(w.sum()) for _, _, w in chunks) == 40 and len(chunks) == 8


def test_padding_rows_add_nothing_to_the_clipped_sum_and_the_sampled_rows_keep_their_own():
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    from torch import nn

    torch.manual_seed(0)
    x, y = torch.randn(4, 3) * 3, torch.tensor([0, 1, 1, 0])
    model = GradSampleModule(nn.Linear(3, 2))
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=1.0,
                            expected_batch_size=4)

    def clipped_sum(inputs, labels, weight):
        optimizer.zero_grad()
        (nn.CrossEntropyLoss(reduction="none")(model(inputs), labels) * weight).mean().backward()
        optimizer.clip_and_accumulate()
        return [p.summed_grad.clone() for p in optimizer.params]

    plain = clipped_sum(x, y, torch.ones(4))
    padded = clipped_sum(torch.cat([x, torch.zeros(5, 3)]), torch.cat([y, torch.zeros(5, dtype=torch.long)]),
                         torch.cat([torch.ones(4), torch.zeros(5)]))
    for a, b in zip(plain, padded):
        torch.testing.assert_close(a, b)


def test_one_channel_images_viewed_from_numpy_give_opacus_each_examples_own_gradient():
    """Digits' [n, 1, 8, 8] array has strides torch reads as channels_last; the padded batches
    hand the model row-major ones, so Opacus's per-example gradient of every convolution (the
    second one was off by up to 0.05 before) is the example's own gradient."""
    from opacus import GradSampleModule

    from conclave.learning.data.digits import load_digits
    from conclave.learning.models.registry import factory_of

    train, _ = load_digits()
    x, y = torch.from_numpy(train.x[:8]), torch.from_numpy(train.y[:8])
    assert x.is_contiguous(memory_format=torch.channels_last)  # the layout that misled Opacus
    batches = PaddedPoissonBatches(x, y, 1.0, 1, records=8, generator=torch.Generator().manual_seed(0))
    [[(inputs, labels, _)]] = list(batches)
    torch.manual_seed(0)
    model = factory_of("digits_cnn")(num_classes=10, in_channels=1)
    for module in model.modules():  # dropout off, so both passes see one function
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    wrapped = GradSampleModule(model, loss_reduction="sum")
    torch.nn.functional.cross_entropy(wrapped(inputs), labels, reduction="sum").backward()
    per_example = {name: p.grad_sample.clone() for name, p in model.named_parameters()}
    wrapped._close()
    for i in range(len(labels)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs[i:i + 1]), labels[i:i + 1], reduction="sum").backward()
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(per_example[name][i], parameter.grad, rtol=1e-4, atol=1e-5)
