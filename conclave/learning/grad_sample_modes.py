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

``clipped`` builds a mode's clipping for DP-SGD: the probe times exactly what a run then trains
with, and every mode follows ``learning.finite_clipping`` (no value of one example makes the
clipped sum non-finite).
"""
from __future__ import annotations

import copy
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from opacus import PrivacyEngine
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conclave.errors import InvalidValue
from conclave.learning.bookkeeping import BookKeeping, private_optimizer
from conclave.learning.finite_clipping import FiniteDPOptimizer, GhostClipping, cross_entropy

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
        raise InvalidValue("no grad_sample_mode to choose from")
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
        raise InvalidValue(f"none of the grad_sample_modes {list(candidates)} runs on this model")
    chosen = min(seconds, key=seconds.__getitem__)
    log.info("grad_sample_mode auto: %s (%s per step at batch %d)", chosen,
             ", ".join(f"{mode} {1e3 * s:.1f} ms" for mode, s in seconds.items()), batch_size)
    return chosen


@dataclass
class Clipped:
    """A model made ready to clip per example one way: call ``module`` on a batch, then
    ``loss(logits, targets).backward()`` and ``optimizer.step()`` for one DP-SGD step; ``close``
    takes every hook off the model."""

    module: nn.Module
    optimizer: DPOptimizer
    loss: Callable[[torch.Tensor, torch.Tensor], Any]
    loader: DataLoader
    hooks: BookKeeping | GhostClipping | None

    def close(self) -> None:
        if self.hooks is not None:
            self.hooks.remove()
        if hasattr(self.module, "to_standard_module"):
            self.module.to_standard_module()  # Opacus's hooks


def privacy_engine(accountant: str = "rdp") -> PrivacyEngine:
    """Opacus's engine without its "Secure RNG turned off" warning, which is not true here: the
    noise generators are seeded from the OS CSPRNG (``privacy.noise``); only Opacus's own
    ``secure_mode`` (torchcsprng, no build for this torch) is off (docs/privacy.md)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        return PrivacyEngine(accountant=accountant)


def clipped(engine: PrivacyEngine, model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, mode: str, *,
            noise_multiplier: float, max_grad_norm: float, expected_batch_size: float, sample_rate: float,
            generator: torch.Generator | None = None,
            optimizer_class: Callable[..., DPOptimizer] = FiniteDPOptimizer) -> Clipped:
    """``model`` clipped the ``mode`` way ("hooks", "functorch", "ew", "ghost" or "bk"), with an
    optimizer that adds N(0, σ²C²) to the clipped sum, divides by ``expected_batch_size`` and
    reports each step to ``engine``'s accountant at ``sample_rate``. ``loader`` must already be
    Poisson (or, in a probe, anything). ``optimizer_class``: the DPOptimizer of the modes that
    materialise per-example gradients (``FiniteDPOptimizer`` or a subclass, e.g. with masks)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus's notes on secure mode and hooks
        if mode == "bk":  # our hooks clip in one backward pass; Opacus's optimizer adds the noise
            clipper, dp_optimizer = private_optimizer(model, optimizer, noise_multiplier=noise_multiplier,
                                                      max_grad_norm=max_grad_norm,
                                                      expected_batch_size=expected_batch_size, generator=generator)
            dp_optimizer.attach_step_hook(engine.accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
            return Clipped(model, dp_optimizer, clipper.loss, loader, clipper)
        made = engine.make_private(module=model, optimizer=optimizer, criterion=nn.CrossEntropyLoss(),
                                   data_loader=loader, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                                   poisson_sampling=False, grad_sample_mode=mode, noise_generator=generator)
    if mode == "ghost":  # Opacus's loss wrapper is replaced by one that drops non-finite examples
        module, dp_optimizer, _, private_loader = made
        dp_optimizer.expected_batch_size = expected_batch_size
        ghost = GhostClipping(module, dp_optimizer, max_grad_norm)
        return Clipped(module, dp_optimizer, ghost.loss, private_loader, ghost)
    module, made_optimizer, private_loader = made
    dp_optimizer = optimizer_class(made_optimizer.original_optimizer, noise_multiplier=noise_multiplier,
                                   max_grad_norm=max_grad_norm, expected_batch_size=expected_batch_size,
                                   loss_reduction=made_optimizer.loss_reduction, generator=made_optimizer.generator)
    dp_optimizer.attach_step_hook(engine.accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
    return Clipped(module, dp_optimizer, cross_entropy, private_loader, None)


def private_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str) -> Callable[[], None]:
    """One DP-SGD step of ``model`` on the batch (x, y) clipped the ``mode`` way (C = 1, σ = 1)."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    made = clipped(privacy_engine(), model, optimizer, DataLoader(TensorDataset(x, y), batch_size=len(y)), mode,
                   noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=len(y), sample_rate=1.0)

    def step() -> None:
        made.optimizer.zero_grad()
        made.loss(made.module(x), y).backward()
        made.optimizer.step()
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
