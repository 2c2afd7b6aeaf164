"""One record at a finite float32 extreme (1e30, ±1e38) leaves DP-SGD's clipped sum finite and
within the clip bound C of the sum without it, in every grad-sample mode (``learning.finite_clipping``):
a fuzz test found every weight NaN after ghost clipping of a hospital table with one value at 1e30.
An example whose loss or gradient norm is not finite adds exactly 0; one whose norm stays finite
in a mode is clipped as usual, so one record moves the sum by at most C either way."""
from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conclave.learning.data.dataset import Dataset
from conclave.learning.data.schema import Standardiser
from conclave.learning.data.sources import DataSource
from conclave.learning.dp_schedule import DPSGDConfig
from conclave.learning.dpsgd import train_dp
from conclave.learning.grad_sample_modes import clipped
from conclave.learning.models import build_model
from conclave.learning.models.table import logistic_regression, mlp
from conclave.privacy.noise import SECURE

torch.set_num_threads(1)

MODES = ("hooks", "functorch", "ew", "ghost", "bk")  # every way to clip per example offered here
EXTREMES = (1e30, 1e38, -1e38)
C = 1.0
HOSPITALS = Path(__file__).resolve().parents[2] / "examples" / "hospitals" / "data"


def _table(factory) -> nn.Module:
    # Column 0's public scale is 1e-3: at ±1e38 the standardised value overflows to ±inf inside the model.
    standardiser = Standardiser(np.zeros(4, np.float32), np.array([1e-3, 1.0, 1.0, 1e3], np.float32))
    model = factory(3, input_shape=(4,), standardiser=standardiser)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights away from 0, so that an extreme input overflows the logits too
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model


def _conv() -> nn.Module:
    """Feature maps [n, 2, 6, 6] (a fixed representation's values need only be finite) through a
    convolution and a GroupNorm, whose saved statistics overflow on an extreme map."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(), nn.Linear(64, 3))


MODELS = {"logistic_regression": (lambda: _table(logistic_regression), (4,)),
          "mlp": (lambda: _table(mlp), (4,)),
          "conv_groupnorm": (_conv, (2, 6, 6))}


def clipped_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str) -> torch.Tensor:
    """Σ_b clip_C(∇ loss_b) over the batch as the ``mode`` clipping of a DP-SGD step leaves it (σ = 0)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus's notes on secure mode and full backward hooks
        made = clipped(PrivacyEngine(), model, optimizer, DataLoader(TensorDataset(x, y), batch_size=len(y)), mode,
                       noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=1.0, sample_rate=1.0)
        made.optimizer.zero_grad()
        made.loss(made.module(x), y).backward()
        made.optimizer.step()
    made.close()
    return torch.cat([parameter.grad.flatten() for parameter in model.parameters()])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_extreme_record_moves_the_clipped_sum_by_at_most_the_clip_bound(name, mode):
    build, shape = MODELS[name]
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn((6, *shape), generator=generator), torch.randint(3, (6,), generator=generator)
    model = build()
    without = clipped_sum(copy.deepcopy(model), torch.cat([x[:2], x[3:]]), torch.cat([y[:2], y[3:]]), mode)
    assert torch.isfinite(without).all() and without.norm() > C  # the others' sum, each clipped to C
    for value in EXTREMES:
        edited = x.clone()
        edited[2].view(-1)[0] = value  # finite in float32, as the owner's reader lets it through
        with_record = clipped_sum(copy.deepcopy(model), edited, y, mode)
        assert torch.isfinite(with_record).all(), (value, mode)
        moved = float((with_record - without).norm())
        assert moved <= C + 1e-4, (value, mode, moved)
        if name == "logistic_regression":  # its gradient's norm overflows in every mode: dropped, adds exactly 0
            assert moved < 1e-5, (value, mode, moved)
        alone = clipped_sum(copy.deepcopy(model), edited[2:3], y[2:3], mode)
        assert torch.isfinite(alone).all() and alone.norm() <= C + 1e-4


def test_ghost_clipping_recomputes_the_forward_with_the_first_passes_random_draws():
    """The second pass of ghost clipping runs the forward again: a dropout layer must draw the same
    masks, or the factors of the first pass would clip other gradients than the ones summed."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn((8, 4), generator=generator), torch.randint(3, (8,), generator=generator)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 3))
    sums = {}
    for mode in ("hooks", "ghost"):
        torch.manual_seed(7)
        sums[mode] = clipped_sum(copy.deepcopy(model), x, y, mode)
    torch.testing.assert_close(sums["ghost"], sums["hooks"], rtol=1e-4, atol=1e-5)


def _hospital_a() -> tuple[Dataset, Standardiser]:
    classes = ("benign", "malignant")
    owner = DataSource("csv", str(HOSPITALS / "hospital_a" / "records.csv"), label="diagnosis")
    records, _ = owner.read_private(classes)
    public = DataSource("csv", str(HOSPITALS / "public" / "test.csv"), label="diagnosis").read(classes)
    return records, Standardiser.of_public(public)


@pytest.mark.parametrize("mode", ["auto", *MODES])
def test_dpsgd_with_one_extreme_record_publishes_the_same_guarantee_and_a_finite_model(mode):
    records, standardiser = _hospital_a()
    # The fuzz test's run (epochs 2, batch 20, σ 2) with every record in every batch (q = 1), so
    # that each step holds the extreme one.
    config = DPSGDConfig(epochs=2, batch_size=len(records.y), noise_multiplier=2.0, grad_sample_mode=mode)

    def run(x: np.ndarray):
        model = build_model("logistic_regression", 2, input_shape=(x.shape[1],), standardiser=standardiser)
        result = train_dp(model, Dataset(x, records.y, 2, "hospital_a"), config, SECURE.source("dpsgd"))
        return result, torch.cat([p.detach().flatten() for p in model.parameters()])

    clean, _ = run(records.x)
    for value in EXTREMES:
        x = records.x.copy()
        x[5, 3] = value  # mean_area of one patient
        result, weights = run(x)
        assert torch.isfinite(weights).all(), (mode, value)
        assert result.steps == clean.steps == 2 and result.epsilons == clean.epsilons
        np.testing.assert_array_equal(result.charge.rdp, clean.charge.rdp)


def test_secure_dpsgd_with_one_extreme_record_ends_with_the_same_finite_model_on_every_rank(tmp_path):
    import socket

    from conclave.learning.dp_schedule import dp_schedule
    from conclave.privacy.accounting.rdp import epsilon_from_rdp
    from tests.learning.extreme_owner import run_rank
    from tests.learning.ranks import run_ranks

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run_ranks(run_rank, (port, str(tmp_path)))
    a, b = np.load(tmp_path / "rank0.npz"), np.load(tmp_path / "rank1.npz")
    assert np.isfinite(a["weights"]).all() and np.array_equal(a["weights"], b["weights"])
    schedule = dp_schedule(25, DPSGDConfig(epochs=2, batch_size=25, noise_multiplier=1.0), secure=True)
    assert int(a["steps"]) == schedule.steps == 2
    assert float(a["epsilon"]) == epsilon_from_rdp(schedule.charge.orders, schedule.charge.rdp, 1e-5)[0]
