"""Two owners' ranks of a data-parallel DP-SGD run, in processes of their own (imported by path
from ``test_secure_dpsgd``): each writes down what it can see of the secure sum, so the test can
replay owner A's attack on owner B's clipped sums and records."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

RECORD_B = np.array([[0.9, -0.4, 0.7]], dtype=np.float32)  # owner B's only record


def owner_data(rank: int):
    from conclave.learning.data import Dataset

    if rank == 1:
        return Dataset(RECORD_B, np.array([1]), 2, "owner-b")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 3)).astype(np.float32)
    return Dataset(x, (x[:, 0] > 0).astype(np.int64), 2, "owner-a")


def run_rank(rank: int, port: int, out: str) -> None:
    import conclave.learning.secure_dpsgd as secure
    from conclave.learning.dp_schedule import DPSGDConfig
    from conclave.learning.dpsgd import train_dp
    from conclave.privacy.noise import SECURE
    from conclave.privacy.secure_sum import MaskKeys

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    seen: dict[str, list[np.ndarray]] = {"quantized": [], "noise": [], "share": [], "total": [], "rows": []}

    def keep(name, function):
        def wrapped(*args, **kwargs):
            value = function(*args, **kwargs)
            seen[name].append(np.array(value))
            return value
        return wrapped

    secure.quantize = keep("quantized", secure.quantize)  # this rank's own clipped sum, as it sends it
    secure.skellam_noise = keep("noise", secure.skellam_noise)  # its own noise share
    reduce = dist.all_reduce

    def observed_all_reduce(tensor, *args, **kwargs):
        seen["share"].append(tensor.numpy().copy())  # what leaves this rank
        result = reduce(tensor, *args, **kwargs)
        seen["total"].append(tensor.numpy().copy())  # what comes back
        return result

    secure.dist.all_reduce = observed_all_reduce
    model = nn.Linear(3, 2)
    # How many inputs each forward pass computes on: what the time to reach the all-reduce follows.
    model.register_forward_pre_hook(lambda module, inputs: seen["rows"].append(np.array(len(inputs[0]))))
    torch.manual_seed(0)
    nn.init.normal_(model.weight, std=0.1)
    nn.init.zeros_(model.bias)
    config = DPSGDConfig(epochs=8, batch_size=10, lr=0.5, max_grad_norm=1.0, noise_multiplier=1.0,
                         grad_sample_mode="hooks")
    keys = MaskKeys(rank)
    public: list = [None, None]
    dist.all_gather_object(public, keys.public_bytes)  # in a run the driver passes them on through Ray
    result = train_dp(model, owner_data(rank), config, SECURE.source(f"dpsgd-{rank}"), num_examples=41,
                      secure_group=secure.SecureGroup(("a", "b"), keys, tuple(public)))
    plan = secure.SecureAggregation(("a", "b"), 8).plan(1.0, result.noise_multiplier, 41, result.steps)
    np.savez(f"{out}/rank{rank}.npz", scale=plan.scale, modulus=plan.modulus, noise_variance=plan.noise_variance,
             **{name: np.stack(values) for name, values in seen.items()})
    dist.destroy_process_group()
