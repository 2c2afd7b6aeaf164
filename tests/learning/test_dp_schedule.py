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



def test_a_screening_runs_steps_are_in_the_schedules_whole_charge_and_its_calibration():
    from conclave.learning.dp_schedule import secure_charge
    from conclave.privacy.accounting.guarantee import worst_case_guarantee

    target = DPSGDConfig(epochs=50, batch_size=1000, target_epsilon=1.0, delta=1e-5)
    alone, screened = dp_schedule(1000, target, secure=True), dp_schedule(1000, target, secure=True, screen_steps=20)
    assert screened.noise_multiplier > alone.noise_multiplier  # the target covers both runs' 70 steps
    whole = worst_case_guarantee(screened.whole_charge, 1e-5).epsilon
    assert whole <= 1.0 and worst_case_guarantee(screened.charge, 1e-5).epsilon < whole
    expected = secure_charge(1.0, screened.noise_multiplier, 70, "x")
    for charge in (screened.whole_charge, screened.charge_after(50, "x")):  # a checkpoint's includes the screening
        assert worst_case_guarantee(charge, 1e-5).epsilon == pytest.approx(worst_case_guarantee(expected, 1e-5).epsilon)
    assert screened.screen_charge.label == "dpsgd-screening" and alone.screen_charge is None
    with pytest.raises(ValueError, match="screening steps run across owners"):
        dp_schedule(1000, target, screen_steps=20)  # one holder: no gateways to screen at
