"""The DP-SGD schedule without torch: a target ε gives the σ Opacus would, so a run trains with
the noise ``conclave plan`` priced."""
from __future__ import annotations

import math

import pytest
from opacus.accountants.utils import get_noise_multiplier

from conclave.learning.dp_schedule import DPSGDConfig, dp_schedule, gaussian_noise_multiplier


@pytest.mark.parametrize("records,batch,epochs,target", [
    (900, 64, 30, 3.0),  # digits-active
    (40000, 1024, 20, 3.0),  # mnist-active
    (10000, 500, 5, 1.0),  # mnist-sparse
    (299, 30, 15, 2.0),
    (1297, 50, 1, 2.0),
])
def test_a_target_epsilon_gives_opacus_noise_multiplier(records, batch, epochs, target):
    sample_rate = 1 / math.ceil(records / batch)
    expected = get_noise_multiplier(target_epsilon=target, target_delta=1e-5, sample_rate=sample_rate, epochs=epochs,
                                    accountant="rdp", epsilon_tolerance=0.005)
    assert gaussian_noise_multiplier(target, 1e-5, sample_rate, epochs) == expected
    schedule = dp_schedule(records, DPSGDConfig(epochs=epochs, batch_size=batch, target_epsilon=target))
    assert schedule.noise_multiplier == expected and schedule.steps == epochs * math.ceil(records / batch)

