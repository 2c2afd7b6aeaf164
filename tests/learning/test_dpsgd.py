"""DP-SGD wrapper: masks act before clipping, frozen weights never move, ε equals Opacus's."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from opacus import GradSampleModule
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp
from torch import nn

from conclave.learning.data import load_digits
from conclave.learning.dp_schedule import DPSGDConfig
from conclave.learning.dpsgd import MaskedDPOptimizer, lr_scheduler, train_dp
from conclave.learning.models.resnet import gn_cnn
from conclave.privacy.accounting.rdp import epsilon_from_rdp
from conclave.privacy.noise import SECURE, NoisePolicy

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def digits():
    train, _ = load_digits()
    return train.subset(np.arange(300))


def _random_masks(model: nn.Module, density: float, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (torch.rand(p.shape, generator=generator) < density).float()
        for name, p in model.named_parameters()
    }


def test_mask_zeroes_per_example_gradients_before_clipping(digits):
    torch.manual_seed(0)
    model = gn_cnn(10, 1, channels=4)
    masks = _random_masks(model, 0.3, seed=1)
    x, y = torch.from_numpy(digits.x[:4]), torch.from_numpy(digits.y[:4])

    # Reference: each example's gradient by plain autograd, masked by hand.
    expected = []
    for i in range(len(y)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum").backward()
        expected.append({n: p.grad.detach() * masks[n] for n, p in model.named_parameters()})
    model.zero_grad()

    clip = 0.05
    wrapped = GradSampleModule(model, loss_reduction="sum")
    params = dict(model.named_parameters())
    optimizer = MaskedDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        masks={params[n]: m for n, m in masks.items()},
        noise_multiplier=1.0,
        max_grad_norm=clip,
        expected_batch_size=4,
        loss_reduction="sum",
        generator=torch.Generator().manual_seed(2),
    )
    nn.functional.cross_entropy(wrapped(x), y, reduction="sum").backward()
    optimizer.clip_and_accumulate()

    masked_norms = torch.tensor(
        [math.sqrt(sum(float(g.norm()) ** 2 for g in e.values())) for e in expected]
    )
    assert torch.all(masked_norms > 4 * clip)  # every example is really clipped
    for name, p in params.items():
        outside = masks[name] == 0
        assert torch.all(p.grad_sample[:, outside] == 0), name
        for i, e in enumerate(expected):
            torch.testing.assert_close(p.grad_sample[i], e[name], rtol=1e-4, atol=1e-6)
        # Clipped with the *masked* norm: sum_i min(1, C/||g_i ⊙ m||) g_i ⊙ m.
        reference = sum((clip / (masked_norms[i] + 1e-6)) * expected[i][name] for i in range(4))
        torch.testing.assert_close(p.summed_grad, reference, rtol=1e-4, atol=1e-7)

    # Each clipped per-example gradient has exactly norm C: the masked gradient's norm
    # decided the clip factor (the unmasked norm would have given a smaller one).
    optimizer.zero_grad()
    nn.functional.cross_entropy(wrapped(x[:1]), y[:1], reduction="sum").backward()
    optimizer.clip_and_accumulate()
    clipped_norm = math.sqrt(sum(float(p.summed_grad.norm()) ** 2 for p in params.values()))
    assert clipped_norm == pytest.approx(clip, rel=1e-4)

    optimizer.add_noise()
    for name, p in params.items():
        outside = masks[name] == 0
        assert torch.all(p.grad[outside] == 0), name
        assert torch.all(p.grad[~outside] != 0), name  # noise reached every trained entry
    wrapped.to_standard_module()


def test_frozen_and_masked_out_weights_are_bit_identical(digits):
    torch.manual_seed(0)
    model = gn_cnn(10, 1, channels=4)
    for p in model.body[0].parameters():
        p.requires_grad_(False)
    masks = {"body.4.weight": (torch.rand(model.body[4].weight.shape) < 0.1).float()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = DPSGDConfig(epochs=2, batch_size=32, lr=0.5, momentum=0.9, noise_multiplier=1.0)
    result = train_dp(model, digits, config, SECURE.source("dpsgd"), masks=masks)
    after = dict(result.model.named_parameters())
    assert result.model is model
    assert torch.equal(after["body.0.weight"], before["body.0.weight"])
    mask = masks["body.4.weight"] == 1
    assert torch.equal(after["body.4.weight"][~mask], before["body.4.weight"][~mask])
    assert torch.all(after["body.4.weight"][mask] != before["body.4.weight"][mask])
    assert not torch.equal(after["classifier.weight"], before["classifier.weight"])
    assert not hasattr(after["classifier.weight"], "grad_sample") or after["classifier.weight"].grad_sample is None


def test_epsilon_equals_opacus_accountant_and_ledger_charge(digits):
    sigma, delta = 1.3, 1e-5
    config = DPSGDConfig(epochs=2, batch_size=50, lr=0.1, noise_multiplier=sigma, delta=delta)
    result = train_dp(gn_cnn(10, 1, channels=4), digits, config, SECURE.source("dpsgd"))
    assert result.sample_rate == pytest.approx(50 / 300)
    assert result.steps == 2 * 6

    accountant = RDPAccountant()
    accountant.history = [(sigma, result.sample_rate, result.steps)]
    assert result.epsilons[-1] == accountant.get_epsilon(delta)
    accountant.history = [(sigma, result.sample_rate, 6)]
    assert result.epsilons[0] == accountant.get_epsilon(delta)

    # The ledger's charge: the same sampled Gaussian RDP (Mironov, Talwar, Zhang 2019) as
    # Opacus wherever Opacus's series is finite, and on Opacus's own orders the same ε.
    orders = result.charge.orders
    opacus_rdp = compute_rdp(q=result.sample_rate, noise_multiplier=sigma, steps=result.steps, orders=orders)
    finite = np.isfinite(opacus_rdp)
    assert finite.sum() >= len(RDPAccountant.DEFAULT_ALPHAS)
    np.testing.assert_allclose(result.charge.rdp[finite], opacus_rdp[finite], rtol=1e-9)
    on_opacus_grid = np.isin(orders, RDPAccountant.DEFAULT_ALPHAS)
    assert on_opacus_grid.sum() == len(RDPAccountant.DEFAULT_ALPHAS)
    eps_same_grid, _ = epsilon_from_rdp(orders[on_opacus_grid], result.charge.rdp[on_opacus_grid], delta)
    assert eps_same_grid == pytest.approx(result.epsilons[-1], rel=1e-9)
    # The ledger's grid has more orders, so its ε can only be lower (here: the same).
    eps_ledger, _ = epsilon_from_rdp(orders, result.charge.rdp, delta)
    assert eps_ledger <= result.epsilons[-1] * (1 + 1e-9)
    assert eps_ledger == pytest.approx(result.epsilons[-1], rel=0.01)


def test_target_epsilon_calibrates_noise(digits, recwarn):
    config = DPSGDConfig(epochs=1, batch_size=50, lr=0.1, target_epsilon=2.0, delta=1e-5)
    result = train_dp(gn_cnn(10, 1, channels=4), digits, config, SECURE.source("dpsgd"))
    # Opacus's "Secure RNG turned off" is not true of our noise (seeded from the OS CSPRNG): not shown
    assert not [w for w in recwarn if "Secure RNG" in str(w.message)]
    assert 1.95 <= result.epsilon <= 2.0
    assert result.noise_multiplier > 0


@pytest.mark.parametrize("mode", ["hooks", "ew", "ghost", "bk"])
def test_empty_poisson_batches_still_take_a_noise_step(digits, mode):
    from conclave.learning.models import build_model

    tiny = digits.subset(np.arange(6))
    config = DPSGDConfig(epochs=3, batch_size=1, lr=0.1, noise_multiplier=1.0, grad_sample_mode=mode)
    model = build_model("digits_cnn", 10, 1, seed=0, input_size=8) if mode == "bk" else gn_cnn(10, 1, channels=4)
    result = train_dp(model, tiny, config, SECURE.source("dpsgd"))
    assert result.steps == 3 * 6  # some of these batches are empty (P = (5/6)^6 ≈ 0.33 each)
    assert all(torch.isfinite(p).all() for p in result.model.parameters())


@pytest.mark.parametrize(
    ("masks", "message"),
    [
        ({"nope.weight": torch.ones(1)}, "unknown parameter"),
        ({"classifier.weight": torch.ones(3, 3)}, "shape"),
        ({"classifier.bias": torch.full((10,), 0.5)}, "only 0 and 1"),
        ({"body.0.weight": None}, "frozen"),
    ],
)
def test_bad_masks_are_rejected(digits, masks, message):
    model = gn_cnn(10, 1, channels=4)
    model.body[0].weight.requires_grad_(False)
    if "body.0.weight" in masks:
        masks = {"body.0.weight": torch.ones(model.body[0].weight.shape)}
    config = DPSGDConfig(epochs=1, batch_size=50, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=message):
        train_dp(model, digits, config, SECURE.source("dpsgd"), masks=masks)


def test_config_needs_exactly_one_noise_setting():
    with pytest.raises(ValueError, match="exactly one"):
        DPSGDConfig(noise_multiplier=1.0, target_epsilon=1.0)
    with pytest.raises(ValueError, match="exactly one"):
        DPSGDConfig()
    with pytest.raises(ValueError, match="grad_sample_mode"):
        DPSGDConfig(noise_multiplier=1.0, grad_sample_mode="ghosts")


@pytest.mark.parametrize("model_name, mode", [("digits_cnn", "ghost"), ("gn_cnn", "ghost"), ("digits_cnn", "ew"),
                                             ("digits_cnn", "bk")])
def test_faster_grad_sample_modes_are_the_same_training(digits, model_name, mode):
    """Ghost clipping finds the same per-example norms without materialising every gradient,
    expanded weights ("ew") the same gradients another way, book-keeping ("bk") the same
    clipped sum in one backward pass: with the same Poisson batches and noise, the weights
    agree with hooks' to rounding."""
    from conclave.learning.models import build_model

    trained = []
    for mode in ("hooks", mode):
        model = build_model(model_name, 10, 1, seed=0, input_size=8)
        config = DPSGDConfig(epochs=2, batch_size=30, lr=0.5, noise_multiplier=1.0, max_grad_norm=0.5,
                             grad_sample_mode=mode)
        trained.append(train_dp(model, digits.subset(np.arange(150)), config,
                                NoisePolicy(insecure_seed=5).source("dpsgd")))
    assert trained[0].steps == trained[1].steps == 10
    assert trained[0].epsilons == trained[1].epsilons
    for (name, a), b in zip(trained[0].model.state_dict().items(), trained[1].model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    initial = build_model(model_name, 10, 1, seed=0, input_size=8).state_dict()
    moved = max(float((initial[name] - a).abs().max()) for name, a in trained[1].model.state_dict().items())
    assert moved > 0.01  # it did train


@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_clipping_without_per_example_gradients_refuses_masks(digits, mode):
    config = DPSGDConfig(epochs=1, batch_size=50, noise_multiplier=1.0, grad_sample_mode=mode)
    with pytest.raises(ValueError, match="masks need per-example gradients"):
        train_dp(gn_cnn(10, 1, channels=4), digits, config, SECURE.source("dpsgd"),
                 masks={"classifier.bias": torch.ones(10)})


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_physical_batch_splitting_is_the_same_training(digits, schedule):
    # Same Poisson batches, same noise, same steps: only the order of floating-point sums
    # changes, so the weights agree to rounding and the privacy cost is identical. With a
    # schedule, the rate moves once per logical step, never per physical chunk.
    masks = {"body.4.weight": (torch.rand(8, 4, 3, 3, generator=torch.Generator().manual_seed(0)) < 0.2).float()}
    base = gn_cnn(10, 1, channels=4).state_dict()
    trained = []
    for physical in (None, 7):
        model = gn_cnn(10, 1, channels=4)
        model.load_state_dict(base)
        config = DPSGDConfig(epochs=2, batch_size=30, lr=0.5, noise_multiplier=1.0,
                             max_physical_batch_size=physical, lr_schedule=schedule)
        # the same reproducible noise (an insecure seed: a test only) for both runs
        noise = NoisePolicy(insecure_seed=5).source("dpsgd")
        trained.append(train_dp(model, digits.subset(np.arange(150)), config, noise, masks=masks))
    assert trained[0].steps == trained[1].steps == 10
    assert trained[0].epsilons == trained[1].epsilons
    for (name, a), b in zip(trained[0].model.state_dict().items(), trained[1].model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_cosine_schedule_decays_every_group_to_zero_over_the_run():
    weights = [nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD([{"params": weights[:1], "lr": 0.4}, {"params": weights[1:], "lr": 2.0}])
    scheduler = lr_scheduler(optimizer, DPSGDConfig(noise_multiplier=1.0, lr_schedule="cosine"), total_steps=4)
    seen = []
    for _ in range(4):
        seen.extend(group["lr"] for group in optimizer.param_groups)
        optimizer.step()
        scheduler.step()
    expected = [0.5 * (1 + math.cos(math.pi * t / 4)) for t in range(4)]  # 1, .854, .5, .146
    assert seen == pytest.approx([lr * f for f in expected for lr in (0.4, 2.0)])
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([0.0, 0.0])
    with pytest.raises(ValueError, match="lr_schedule"):
        DPSGDConfig(noise_multiplier=1.0, lr_schedule="linear")


def test_two_runs_release_different_noise_unless_reproducible_noise_is_asked_for(digits):
    base = gn_cnn(10, 1, channels=4).state_dict()
    config = DPSGDConfig(epochs=1, batch_size=50, lr=0.5, noise_multiplier=1.0)

    def weights(noise) -> torch.Tensor:
        model = gn_cnn(10, 1, channels=4)
        model.load_state_dict(base)  # the same initialisation: only sampling and noise can differ
        return train_dp(model, digits, config, noise).model.classifier.weight.detach().clone()

    assert not torch.equal(weights(SECURE.source("dpsgd")), weights(SECURE.source("dpsgd")))
    replay = NoisePolicy(insecure_seed=11)
    assert torch.equal(weights(replay.source("dpsgd")), weights(replay.source("dpsgd")))


def test_every_planned_step_is_taken_when_one_over_q_rounds_down(digits):
    # 1/(1/93) is 92.99999999999999 in floating point, so Opacus's loader alone takes 92 steps
    # an epoch; the schedule (and the ledger's charge) says 93.
    assert int(1 / (1 / 93)) == 92
    result = train_dp(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), digits.subset(np.arange(93)),
                      DPSGDConfig(epochs=1, batch_size=1, lr=0.1, noise_multiplier=1.0), SECURE.source("dpsgd"))
    assert result.steps == 93 and result.sample_rate == 1 / 93


def test_the_schedule_comes_from_the_declared_size_not_the_records_held(digits):
    config = DPSGDConfig(epochs=2, batch_size=50, lr=0.1, noise_multiplier=1.0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    # 300 records held, 1,000 declared: 20 steps an epoch at q = 1/20, as for any 951..1,000 records
    result = train_dp(model, digits, config, SECURE.source("dpsgd"), num_examples=1_000)
    assert (result.steps, result.sample_rate) == (40, 1 / 20)
    fewer = train_dp(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), digits.subset(np.arange(10)), config,
                     SECURE.source("dpsgd"), num_examples=1_000)
    np.testing.assert_allclose(fewer.charge.rdp, result.charge.rdp)  # the same cost: it is the declared work


def test_auto_mode_times_the_candidates_on_a_copy_and_keeps_one():
    """The probe runs on synthetic data and a copy: the model's weights and the global RNG are
    as they were; a mode Opacus cannot run is skipped, and none at all is one clear error."""
    from conclave.learning.grad_sample_modes import PROBED, fastest_mode

    model = gn_cnn(10, 1, channels=4)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    rng_state = torch.get_rng_state()
    assert fastest_mode(model, (1, 8, 8), 16, PROBED) in PROBED
    assert fastest_mode(model, (1, 8, 8), 16, ("no-such-mode", "ew")) == "ew"
    with pytest.raises(ValueError, match="none of the grad_sample_modes"):
        fastest_mode(model, (1, 8, 8), 16, ("no-such-mode", "nor-this"))
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())


@pytest.mark.parametrize("masked, reproducible", [(False, False), (True, False), (False, True)])
def test_auto_mode_probes_every_mode_unless_masks_or_reproducible_noise_need_the_hooks(digits, monkeypatch, masked,
                                                                                     reproducible):
    """Reproducible noise must give the same weights every run, so no timing may choose the
    mode there (modes agree to rounding only)."""
    from conclave.learning import dpsgd
    from conclave.learning.grad_sample_modes import PROBED

    asked = []

    def record(model, example_shape, batch_size, candidates, device):
        asked.append((tuple(example_shape), batch_size, tuple(candidates)))
        return candidates[0]

    monkeypatch.setattr(dpsgd, "fastest_mode", record)
    masks = {"classifier.bias": torch.ones(10)} if masked else None
    config = DPSGDConfig(epochs=1, batch_size=50, noise_multiplier=1.0)
    noise = (NoisePolicy(insecure_seed=3) if reproducible else SECURE).source("dpsgd")
    train_dp(gn_cnn(10, 1, channels=4), digits.subset(np.arange(200)), config, noise, masks=masks)
    # q = 1/4 of 200 records: the probe batch is the expected batch, 50
    assert asked == [((1, 8, 8), 50, ("hooks",) if masked or reproducible else PROBED)]


@pytest.mark.parametrize("name, shape, kwargs", [
    ("digits_cnn", (1, 8, 8), {}), ("tutorial_cnn", (1, 28, 28), {}), ("scatternet_cnn", (81, 7, 7), {}),
    ("gn_cnn", (3, 32, 32), {}), ("gn_resnet18", (3, 16, 16), {"width": 0.25}),
    ("mlp", (5,), {}), ("logistic_regression", (5,), {})])
def test_book_keeping_leaves_the_clipped_sum_of_the_per_example_gradients(name, shape, kwargs):
    """Against Opacus's per-example gradients, clipped and summed one by one; the clipping norm
    is the median, so half the examples are clipped and half are not. ScatterNet's convolutions,
    one of gn_cnn's and the ResNet's later stages take the ghost-norm path, the other
    convolutions the formed one."""
    from conclave.learning.bookkeeping import BookKeeping
    from conclave.learning.models import build_model

    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn((40, *shape), generator=generator), torch.randint(0, 10, (40,), generator=generator)
    model = build_model(name, 10, input_shape=shape, seed=1, **kwargs)
    per_example = GradSampleModule(model, loss_reduction="sum")
    nn.functional.cross_entropy(per_example(x), y, reduction="sum").backward()
    samples = {n: p.grad_sample.flatten(1).clone() for n, p in model.named_parameters()}
    per_example._close()
    norms = torch.cat(list(samples.values()), 1).norm(dim=1)
    clip = float(norms.median())
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    assert 0 < int((factors < 1).sum()) < len(factors)
    for p in model.parameters():
        p.grad = None
    clipper = BookKeeping(model, clip)
    clipper.loss(model(x), y).backward()
    clipper.remove()
    for n, p in model.named_parameters():
        expected = (factors @ samples[n]).view_as(p)  # float32 sums in another order: rounding to the scale
        torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()), msg=n)


@pytest.mark.parametrize("in_channels, out_channels, kernel, stride, padding, dilation, side", [
    (81, 32, 3, 1, 1, 1, 7), (3, 8, 5, 2, 2, 1, 11), (4, 6, 3, 2, 0, 2, 13), (5, 7, (3, 2), (1, 2), (2, 1), 1, 9)])
def test_convolution_ghost_norms_equal_the_norms_of_per_example_gradients(in_channels, out_channels, kernel, stride,
                                                                          padding, dilation, side):
    """The ghost norm from the input's Gram matrix, on strided, dilated, rectangular and
    unevenly padded convolutions, against each example's weight gradient taken by autograd."""
    from conclave.learning.bookkeeping import _conv_ghost_norms_squared

    generator = torch.Generator().manual_seed(0)
    conv = nn.Conv2d(in_channels, out_channels, kernel, stride, padding, dilation).double()
    x = torch.randn(5, in_channels, side, side, generator=generator, dtype=torch.double)
    grad = torch.randn_like(conv(x))
    expected = torch.stack([torch.autograd.grad((conv(x[b:b + 1]) * grad[b:b + 1]).sum(), conv.weight)[0].square().sum()
                            for b in range(len(x))])
    torch.testing.assert_close(_conv_ghost_norms_squared(conv, x, grad), expected, rtol=1e-10, atol=0)


def test_book_keeping_refuses_what_it_cannot_clip():
    from conclave.learning.bookkeeping import BookKeeping

    with pytest.raises(ValueError, match="Linear, Conv2d, GroupNorm layers only.*BatchNorm2d"):
        BookKeeping(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)), 1.0)
    shared = nn.Linear(4, 4)
    twice = BookKeeping(nn.Sequential(shared, nn.Tanh(), shared), 1.0)
    with pytest.raises(ValueError, match="ran twice"):
        twice.loss(nn.Sequential(shared, nn.Tanh(), shared)(torch.randn(3, 4)), torch.tensor([0, 1, 2]))
    sequence = nn.Linear(4, 3)
    with pytest.raises(ValueError, match="rows only"):
        BookKeeping(sequence, 1.0).loss(sequence(torch.randn(2, 5, 4)).sum(1), torch.tensor([0, 1]))
