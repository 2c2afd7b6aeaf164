"""The sparse fine-tuning actor: charges the ledger first, trains only the plan, refuses overspend."""
from __future__ import annotations

import numpy as np
import pytest
import ray

from actors.sparse_trainer import PublicModel, SparseTrainer, SparseTrainerActor, TransferSource
from learning.data import load_digits
from learning.dpsgd import DPSGDConfig, dp_schedule
from learning.models import build_model
from learning.sparse import magnitude_masks, select_classes
from learning.training import TrainConfig, evaluate, fit
from privacy.accounting.filter import RenyiFilter, filter_for
from privacy.accounting.ledger import BudgetExceeded, PrivacyLedger
from privacy.accounting.rdp import epsilon_from_rdp
from privacy.noise import SECURE

DELTA = 1e-5


@pytest.fixture(scope="module")
def public_model() -> PublicModel:
    train, _ = load_digits()
    public = select_classes(train, (0, 1, 2, 3, 4))
    model = build_model("gn_cnn", 5, 1, channels=4, seed=0)
    fit(model, public, TrainConfig(epochs=2, batch_size=64, lr=3e-3))
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return PublicModel("gn_cnn", 5, 1, {"channels": 4}, state)


SOURCE = TransferSource("digits", classes=(5, 6, 7, 8, 9), size=400, seed=0)


def test_finetune_charges_ledger_and_keeps_masked_weights(ray_session, tmp_path, public_model):
    ledger_path = str(tmp_path / "ledger.sqlite")
    config = DPSGDConfig(epochs=3, batch_size=80, lr=0.5, noise_multiplier=1.0, delta=DELTA,
                         lr_overrides=(("classifier.", 1.0),))
    budget = filter_for(dp_schedule(400, config).charge, 20.0, DELTA)
    actor = SparseTrainerActor.remote(SOURCE, ledger_path, DELTA, budget, SECURE)
    assert ray.get(actor.size.remote()) == 400
    result = ray.get(actor.finetune.remote(public_model, "all", 0.1, config))
    ray.get(actor.close.remote())

    # The charge in the ledger is the run's: same ε as the Opacus accountant reported.
    with PrivacyLedger.open_existing(ledger_path) as with_ledger:
        report = with_ledger.report()
    assert report.charges == 1 and report.bounded and report.budget == budget
    assert report.epsilon_spent == pytest.approx(result.epsilons[-1], rel=0.01)
    assert report.epsilon_spent == pytest.approx(result.budget.epsilon_spent, rel=1e-12)
    assert result.steps == 3 * 5 and result.sample_rate == pytest.approx(0.2)

    # Masked-out convolution weights are exactly the public ones; masked-in ones moved.
    public_net = public_model.build()
    masks = magnitude_masks(public_net, 0.1)
    for name, mask in masks.items():
        before, after = public_model.state[name], result.state[name]
        frozen = mask.numpy() == 0
        assert np.array_equal(after[frozen], before[frozen]), name
        assert np.all(after[~frozen] != before[~frozen]), name
    assert result.state["classifier.weight"].shape == (5, public_net.classifier.in_features)
    # it learned the private task (measured on its public test split, outside the actor)
    _, private_test = load_digits()
    released = PublicModel("gn_cnn", 5, 1, {"channels": 4}, result.state).build()
    assert evaluate(released, select_classes(private_test, (5, 6, 7, 8, 9))) > 0.4  # chance is 0.2


def test_overspending_is_refused_before_training(tmp_path, public_model):
    # The actor's class in-process (the Ray path is exercised above): same ledger, same code.
    ledger_path = str(tmp_path / "ledger.sqlite")
    trainer = SparseTrainer(SOURCE, ledger_path, DELTA, RenyiFilter(0.5, DELTA, 256.0), SECURE)
    config = DPSGDConfig(epochs=3, batch_size=80, lr=0.5, noise_multiplier=1.0, delta=DELTA)
    with pytest.raises(BudgetExceeded, match="over the budget"):
        trainer.finetune(public_model, "classifier", 0.01, config)
    with pytest.raises(ValueError, match="delta"):
        trainer.finetune(public_model, "classifier", 0.01, DPSGDConfig(noise_multiplier=1.0, delta=1e-6))
    trainer.close()
    with PrivacyLedger.open_existing(ledger_path) as ledger:
        assert ledger.report().charges == 0


def test_charge_matches_the_schedule_epsilon(public_model):
    # Independent of Ray: the ledger's ε for the schedule equals Opacus's for the same run.
    from learning.dpsgd import dp_schedule
    from opacus.accountants import RDPAccountant

    config = DPSGDConfig(epochs=3, batch_size=80, noise_multiplier=1.0, delta=DELTA)
    schedule = dp_schedule(400, config)
    accountant = RDPAccountant()
    accountant.history = [(1.0, schedule.sample_rate, schedule.steps)]
    on_opacus_grid = np.isin(schedule.charge.orders, RDPAccountant.DEFAULT_ALPHAS)
    eps, _ = epsilon_from_rdp(schedule.charge.orders[on_opacus_grid], schedule.charge.rdp[on_opacus_grid], DELTA)
    assert eps == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-9)
