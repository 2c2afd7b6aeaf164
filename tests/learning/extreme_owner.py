"""Two owners' ranks of a data-parallel DP-SGD run, in processes of their own (imported by path
from ``test_finite_clipping``): owner B holds one record at float32's edge, first among its rows
so that its padding rows copy it too. Each rank writes down the weights it ends with and its ε."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

EXTREME = 1e38  # column 0's public scale is 1e-3: the standardised value overflows to inf


def owner_data(rank: int):
    from conclave.learning.data import Dataset

    rng = np.random.default_rng(rank)
    x = rng.normal(size=(5 if rank else 20, 3)).astype(np.float32)
    if rank == 1:
        x[0, 0] = EXTREME
    return Dataset(x, (x[:, 1] > 0).astype(np.int64), 2, f"owner-{rank}")


def run_rank(rank: int, port: int, out: str) -> None:
    from conclave.learning.data.schema import Standardiser
    from conclave.learning.dp_schedule import DPSGDConfig
    from conclave.learning.dpsgd import train_dp
    from conclave.learning.models.table import logistic_regression
    from conclave.learning.secure_dpsgd import SecureGroup
    from conclave.privacy.noise import SECURE
    from conclave.privacy.secure_sum import MaskKeys

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    keys = MaskKeys(rank)
    public: list = [None, None]
    dist.all_gather_object(public, keys.public_bytes)  # in a run the driver passes them on through Ray
    standardiser = Standardiser(np.zeros(3, np.float32), np.array([1e-3, 1.0, 1.0], np.float32))
    model = logistic_regression(2, input_shape=(3,), standardiser=standardiser)
    # Every record in every batch (q = 1), so that each step holds the extreme one.
    config = DPSGDConfig(epochs=2, batch_size=25, lr=0.5, noise_multiplier=1.0, grad_sample_mode="hooks")
    result = train_dp(model, owner_data(rank), config, SECURE.source(f"dpsgd-{rank}"), num_examples=25,
                      secure_group=SecureGroup(("a", "b"), keys, tuple(public)))
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    np.savez(f"{out}/rank{rank}.npz", weights=weights, epsilon=result.epsilon, steps=result.steps)
    dist.destroy_process_group()
