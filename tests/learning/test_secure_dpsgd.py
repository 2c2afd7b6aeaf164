"""DP-SGD across owners through the secure sum: owner A's rank, curious, replays the attack that
worked on Opacus's plaintext all-reduce (recover B's clipped sum, then B's record from a
linear model's gradient) and holds only B's sum under noise of the planned variance."""
from __future__ import annotations

import socket

import numpy as np
import torch.multiprocessing as mp

from tests.learning.curious_owner import RECORD_B, run_rank


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_curious_owner_holds_only_the_noised_total_of_the_other_owners_clipped_sums(tmp_path):
    mp.start_processes(run_rank, args=(_free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
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

    # What each rank sends is uniform on the ring whatever its value.
    shares = np.concatenate([a["share"].ravel(), b["share"].ravel()]).astype(np.float64) / modulus
    assert 0 <= shares.min() and shares.max() < 1 and abs(shares.mean() - 0.5) < 0.1
