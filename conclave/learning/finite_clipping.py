"""Per-example clipping that no value of one example can break.

An example whose loss or per-example gradient norm is not finite is clipped with factor 0 and its
rows zeroed before any sum over the batch, elementwise, never by a branch or a count: so one
record moves the clipped sum by at most C whatever it holds. Why Opacus's factor alone does not:
docs/privacy.md, "Clipping no record can break".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from torch import nn
from torch.utils.hooks import RemovableHandle


def clip_factors(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """Opacus's per-example factor min(1, C / (‖g‖ + 1e-6)), and exactly 0 where ‖g‖ is not finite."""
    return torch.where(torch.isfinite(norms), (max_grad_norm / (norms + 1e-6)).clamp(max=1.0), 0.0)


def rows(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``values`` [n, ...] with the rows where ``keep`` [n] is False set to exactly 0 (NaN and inf included)."""
    return torch.where(keep.view(-1, *[1] * (values.dim() - 1)), values, 0.0)


def finite_losses(losses: torch.Tensor) -> torch.Tensor:
    """Per-example losses with the non-finite ones set to 0: no gradient reaches those examples'
    outputs but 0 (or NaN, which the norms then drop), and the batch's loss stays finite."""
    return torch.where(torch.isfinite(losses), losses, 0.0)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The batch's mean cross-entropy for modes that materialise per-example gradients, with a
    non-finite example's loss left out of the graph (Opacus scales by the rows, so still a mean)."""
    return finite_losses(F.cross_entropy(logits, targets, reduction="none")).mean()


class FiniteDPOptimizer(DPOptimizer):
    """Opacus's flat-clipping ``DPOptimizer`` with the rule of this module: per-example gradients
    whose norm is not finite are zeroed (in place: they are outside the autograd graph and
    consumed here) and get factor 0."""

    def clip_and_accumulate(self) -> None:
        flat = [self._get_flat_grad_sample(p).to(p.dtype) for p in self.params]
        if len(flat[0]) == 0:  # an empty Poisson batch: nothing to clip
            factors = torch.zeros((0,), device=flat[0].device)
        else:
            norms = torch.stack([g.reshape(len(g), -1).norm(2, dim=-1).to(flat[0].device) for g in flat], dim=1)
            factors = clip_factors(norms.norm(2, dim=1), self.max_grad_norm)
        dropped = factors == 0
        for p, grad_sample in zip(self.params, flat):
            _check_processed_flag(p.grad_sample)
            grad_sample.masked_fill_(dropped.to(grad_sample.device).view(-1, *[1] * (grad_sample.dim() - 1)), 0.0)
            grad = torch.einsum("i,i...", factors.to(grad_sample.device, p.dtype), grad_sample)
            p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad
            _mark_as_processed(p.grad_sample)


class GhostClipping:
    """Opacus's ghost clipping (``grad_sample_mode="ghost"``) under the rule of this module.

    Its second backward pass is a plain backward of Σ c_b · loss_b, whose parameter gradients sum
    over the batch products of each example's output gradient with what its forward pass saved
    (a layer's input, a GroupNorm's normalised values...): c_b = 0 does not stop 0 · inf = NaN
    there. So the second pass recomputes the batch's forward with the dropped examples' inputs set
    to 0 (Opacus's hooks off, the random generators where the first forward had them, so dropout
    draws alike); the other examples' values are the first forward's, and a dropped example's are
    those of an all-zero input, finite for any model whose forward is finite at 0 (nothing of the
    dropped record enters the pass). The first pass, which takes the norms, is Opacus's own.
    Recomputing every batch costs one more forward pass a step, whether or not one is dropped.

    ``loss(logits, targets)`` stands for Opacus's ``DPLossFastGradientClipping``: its result's
    ``backward()`` leaves the clipped sum in ``.grad`` for ``DPOptimizerFastGradientClipping``.
    """

    def __init__(self, module: GradSampleModuleFastGradientClipping, optimizer: DPOptimizerFastGradientClipping,
                 max_grad_norm: float) -> None:
        self.module, self.optimizer, self.max_grad_norm = module, optimizer, max_grad_norm
        self._inputs: tuple = ()  # the last forward's inputs, and the random state it started from
        self._random: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._recomputing = False
        self._handle: RemovableHandle = module._module.register_forward_pre_hook(self._remember)

    def _remember(self, module: nn.Module, inputs: tuple) -> None:
        if self._recomputing or not torch.is_grad_enabled():
            return
        cuda = next((v.device for v in inputs if torch.is_tensor(v) and v.is_cuda), None)
        self._inputs = inputs
        self._random = (torch.get_rng_state(), None if cuda is None else torch.cuda.get_rng_state(cuda))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> GhostLoss:
        return GhostLoss(self, F.cross_entropy(logits, targets, reduction="none"), targets, self._inputs,
                         self._random)

    def recompute(self, inputs: tuple, keep: torch.Tensor,
                  random: tuple[torch.Tensor, torch.Tensor | None] | None) -> torch.Tensor:
        """The logits of ``inputs`` with the rows of the examples not kept set to 0, drawing the
        same random numbers as the forward that ``random`` was taken before."""
        cpu_state, cuda_state = random if random is not None else (torch.get_rng_state(), None)
        cuda = keep.device if cuda_state is not None else None
        zeroed = tuple(rows(v, keep.to(v.device)) if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0
                       else v for v in inputs)
        self._recomputing = True
        try:
            with torch.random.fork_rng(devices=[] if cuda is None else [cuda]):
                torch.set_rng_state(cpu_state)
                if cuda is not None:
                    torch.cuda.set_rng_state(cuda_state, cuda)
                return self.module(*zeroed)
        finally:
            self._recomputing = False

    def remove(self) -> None:
        self._handle.remove()


@dataclass(frozen=True)
class GhostLoss:
    """One batch's per-example losses under ``GhostClipping``, with what its forward was given."""

    clipping: GhostClipping
    per_example: torch.Tensor
    targets: torch.Tensor
    inputs: tuple
    random: tuple[torch.Tensor, torch.Tensor | None] | None

    def backward(self) -> None:
        """Opacus's two passes (``DPTensorFastGradientClipping.backward``): the norms, then the
        clipped sum as the gradient of Σ c_b · loss_b over a forward without the dropped examples."""
        ghost = self.clipping
        self.per_example.mean().backward()  # Opacus's hooks take the per-example norms
        ghost.optimizer.zero_grad()
        factors = clip_factors(ghost.module.get_norm_sample(), ghost.max_grad_norm).to(self.per_example.device)
        keep = torch.isfinite(self.per_example.detach()) & (factors > 0)
        ghost.module.disable_hooks()
        try:
            losses = F.cross_entropy(ghost.recompute(self.inputs, keep, self.random), self.targets, reduction="none")
            torch.where(keep, factors * losses, 0.0).sum().backward()
        finally:
            ghost.module.enable_hooks()
