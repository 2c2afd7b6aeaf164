"""FixMatch with ``ema_decay``: the model ends with the moving average of its weights over the steps."""
from __future__ import annotations

import pytest
import torch

from conclave.learning.data import make_splits
from conclave.learning.models import build_model
from conclave.learning.semi_supervised import FixMatchConfig, fixmatch


def _trained(decay: float | None, initial: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    splits = make_splits("digits", None, public_size=300, seed=0)
    pool = splits.public.x
    model = build_model("digits_cnn", 10, input_shape=pool.shape[1:], seed=0)
    if initial is not None:
        initial.update({k: v.clone() for k, v in model.state_dict().items()})
    config = FixMatchConfig(epochs=2, batch_size=16, threshold=0.9, ema_decay=decay)
    fixmatch(model, pool[:40], splits.public.y[:40], pool, config)
    assert not model.training
    return model.state_dict()


def test_the_model_ends_with_the_moving_average_of_its_weights():
    initial: dict[str, torch.Tensor] = {}
    last = _trained(None, initial)
    forgetful = _trained(1e-9)   # the average is the last step's weights
    steady = _trained(1 - 1e-9)  # the average is the first step's weights, next to the initial ones
    for name, weights in last.items():
        assert torch.allclose(forgetful[name], weights, atol=1e-6), name
        moved = (weights - initial[name]).norm()
        assert (steady[name] - initial[name]).norm() < 0.2 * moved + 1e-6, name


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5])
def test_a_decay_outside_the_open_unit_interval_is_refused(decay):
    with pytest.raises(ValueError, match="ema_decay"):
        FixMatchConfig(ema_decay=decay)
