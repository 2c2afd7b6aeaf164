"""Which way to clip per example is fastest for a model: the "auto" mode.

No mode wins everywhere, and the winner changes with the batch. On 2 CPU cores at batch 256
(``bench/perf.py``), of Opacus's modes expanded weights ("ew") was fastest for most of our
models and ghost clipping for ``digits_cnn`` at some batch sizes; book-keeping ("bk",
``learning.bookkeeping``) was fastest for every model in the last runs except ``gn_cnn``,
where it and "ew" are within a few percent. So "auto" times steps of each candidate on a copy
of the model, on a synthetic batch of the training's size, and keeps the fastest (modes closer
than its timing can tell apart may go either way).

The probe reads no private data (random inputs of the model's input shape, random labels,
a throwaway copy of the model), and which mode wins changes rounding only: each computes the
same clipped sum, to which the same noise is added. The privacy is the same whichever runs;
a run with reproducible noise skips the probe (``learning.dpsgd``), since rounding would
differ between runs.
"""
from __future__ import annotations

import copy
import logging
import time
import warnings
from typing import Callable, Sequence

import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conclave.learning.bookkeeping import private_optimizer

log = logging.getLogger(__name__)

MATERIALISING = ("hooks", "functorch", "ew")  # every per-example gradient exists before clipping
# The candidates of "auto" ("functorch" was never faster than "hooks"); "bk" is book-keeping
# (learning.bookkeeping), which refuses models with layers it cannot clip.
PROBED = ("hooks", "ew", "ghost", "bk")


def fastest_mode(model: nn.Module, example_shape: Sequence[int], batch_size: int, candidates: Sequence[str] = PROBED,
                 device: torch.device | None = None, repetitions: int = 2) -> str:
    """The fastest of ``candidates`` for a DP-SGD step of ``model`` on ``batch_size`` synthetic
    examples of ``example_shape``, the best of ``repetitions`` timed steps after a warm-up.
    A mode that fails on this model is skipped; if all but one fail, that one is chosen."""
    if not candidates:
        raise ValueError("no grad_sample_mode to choose from")
    if len(candidates) == 1:
        return candidates[0]
    device = device or torch.device("cpu")
    generator = torch.Generator().manual_seed(0)  # the synthetic batch; the global RNG is left alone
    x = torch.randn((batch_size, *example_shape), generator=generator).to(device)
    with torch.no_grad():
        classes = copy.deepcopy(model).to(device).eval()(x[:1]).shape[-1]
    y = torch.randint(classes, (batch_size,), generator=generator).to(device)
    seconds: dict[str, float] = {}
    for mode in candidates:
        # The probe's optimizer draws its (unused) noise from torch's global generator: fork it,
        # so the caller's seeded randomness is as it was.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            try:
                seconds[mode] = _time_mode(copy.deepcopy(model).to(device).train(), x, y, mode, repetitions)
            except Exception as err:  # noqa: BLE001 - a mode Opacus cannot run on this model is not a candidate
                log.debug("grad_sample_mode %s does not run on this model: %s", mode, err)
    if not seconds:
        raise ValueError(f"none of the grad_sample_modes {list(candidates)} runs on this model")
    chosen = min(seconds, key=seconds.__getitem__)
    log.info("grad_sample_mode auto: %s (%s per step at batch %d)", chosen,
             ", ".join(f"{mode} {1e3 * s:.1f} ms" for mode, s in seconds.items()), batch_size)
    return chosen


def private_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str) -> Callable[[], None]:
    """One DP-SGD step of ``model`` on the batch (x, y) clipped the ``mode`` way (C = 1, σ = 1)."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus's notes on secure mode and hooks
        if mode == "bk":
            clipper, dp_optimizer = private_optimizer(model, optimizer, noise_multiplier=1.0, max_grad_norm=1.0,
                                                      expected_batch_size=len(y))
            private_model, criterion = model, clipper.loss
        else:
            made = PrivacyEngine().make_private(
                module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x, y), batch_size=len(y)),
                criterion=nn.CrossEntropyLoss(), noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
                grad_sample_mode=mode)
            private_model, dp_optimizer = made[0], made[1]
            criterion = made[2] if mode == "ghost" else nn.CrossEntropyLoss()

    def step() -> None:
        dp_optimizer.zero_grad()
        criterion(private_model(x), y).backward()
        dp_optimizer.step()
    return step


def _time_mode(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str, repetitions: int) -> float:
    step = private_step(model, x, y, mode)
    best = float("inf")
    for repetition in range(repetitions + 1):  # the first is a warm-up
        started = time.perf_counter()
        step()
        if repetition:
            best = min(best, time.perf_counter() - started)
    return best
