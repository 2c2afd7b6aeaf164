"""Sparse fine-tuning on shard actors: only the plan trains, the cost is the schedule's."""
from __future__ import annotations

import numpy as np
import pytest

from conclave.actors.dp_trainer import ShardGroup, ShardPlan
from conclave.actors.sparse_trainer import PublicModel, SparseVariant, TransferSource
from conclave.learning.data import load_digits
from conclave.learning.dp_schedule import DPSGDConfig, dp_schedule
from conclave.learning.models import build_model
from conclave.learning.sparse import magnitude_masks, select_classes
from conclave.learning.train_config import TrainConfig
from conclave.learning.training import evaluate, fit
from conclave.privacy.accounting.rdp import epsilon_from_rdp
from conclave.privacy.noise import SECURE

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


def test_a_shard_actor_finetunes_the_variant_and_only_its_masked_weights_move(ray_session, public_model):
    config = DPSGDConfig(epochs=3, batch_size=80, lr=0.5, noise_multiplier=1.0, delta=DELTA,
                         lr_overrides=(("classifier.", 1.0),))
    recipe = SparseVariant(public_model, "all", 0.1, num_classes=5)
    with ShardGroup([ShardPlan(SOURCE, (0,))], num_cpus=0.5) as group:
        checkpoints = group.train(config, SECURE, 400, recipe)
    state = checkpoints[-1].state
    assert checkpoints[-1].steps == 3 * 5 and checkpoints[-1].sample_rate == pytest.approx(0.2)
    # what the driver charges for it (the schedule) is what Opacus's accountant says it spent
    charged, _ = epsilon_from_rdp(checkpoints[-1].charge().orders, checkpoints[-1].charge().rdp, DELTA)
    assert charged == pytest.approx(checkpoints[-1].epsilon, rel=0.01)
    np.testing.assert_allclose(checkpoints[-1].charge().rdp, dp_schedule(400, config).charge.rdp)

    # Masked-out convolution weights are exactly the public ones; masked-in ones moved.
    public_net = public_model.build()
    masks = magnitude_masks(public_net, 0.1)
    for name, mask in masks.items():
        before, after = public_model.state[name], state[name]
        frozen = mask.numpy() == 0
        assert np.array_equal(after[frozen], before[frozen]), name
        assert np.all(after[~frozen] != before[~frozen]), name
    assert state["classifier.weight"].shape == (5, public_net.classifier.in_features)
    # it learned the private task (measured on its public test split, outside the actor)
    _, private_test = load_digits()
    assert evaluate(recipe.released(state), select_classes(private_test, (5, 6, 7, 8, 9))) > 0.4  # chance: 0.2


def test_a_transfer_set_is_one_shard():
    with pytest.raises(ValueError, match="one shard"):
        SOURCE.load([1])


def test_charge_matches_the_schedule_epsilon(public_model):
    # Independent of Ray: the ledger's ε for the schedule equals Opacus's for the same run.
    from conclave.learning.dp_schedule import dp_schedule
    from opacus.accountants import RDPAccountant

    config = DPSGDConfig(epochs=3, batch_size=80, noise_multiplier=1.0, delta=DELTA)
    schedule = dp_schedule(400, config)
    accountant = RDPAccountant()
    accountant.history = [(1.0, schedule.sample_rate, schedule.steps)]
    on_opacus_grid = np.isin(schedule.charge.orders, RDPAccountant.DEFAULT_ALPHAS)
    eps, _ = epsilon_from_rdp(schedule.charge.orders[on_opacus_grid], schedule.charge.rdp[on_opacus_grid], DELTA)
    assert eps == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-9)
