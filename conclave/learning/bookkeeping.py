"""Per-example clipping in one backward pass, without per-example gradients of Linear layers.

Book-keeping (Bu, Wang, Zha & Karypis, ICML 2023): the clipped sum ``(c ⊙ g)ᵀ a`` from the
layers' inputs and output gradients, with per-example norms from ``‖a_b‖‖g_b‖`` (Conv2d: formed
as Opacus does, or ghost norms). The same clipped sum as Opacus's hooks, without their
[n, out, in] tensors; noise and privacy are Opacus's. Models outside ``LAYERS`` are refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from opacus.optimizers import DPOptimizerFastGradientClipping
from torch import nn
from torch.utils.hooks import RemovableHandle

from conclave.errors import InvalidValue
from conclave.learning.finite_clipping import clip_factors, rows


class BookKeeping:
    """Hooks on ``model`` that record each trainable layer's input and output; ``backward``
    then leaves the sum of the clipped per-example gradients in every trainable ``.grad``."""

    def __init__(self, model: nn.Module, max_grad_norm: float) -> None:
        self.max_grad_norm = max_grad_norm
        self.layers = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
        unsupported = [type(m).__name__ for m in self.layers if type(m) not in LAYERS]
        if unsupported:
            raise InvalidValue(f"book-keeping clips {', '.join(t.__name__ for t in LAYERS)} layers only; "
                             f"this model trains {unsupported}")
        if any(type(m) is nn.Conv2d and (m.padding_mode != "zeros" or isinstance(m.padding, str)) for m in self.layers):
            raise InvalidValue("book-keeping clips Conv2d layers with numeric zero padding only")
        self.params = [p for m in self.layers for p in m.parameters(recurse=False) if p.requires_grad]
        self._recorded: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handles: list[RemovableHandle] = [m.register_forward_hook(self._record) for m in self.layers]

    def _record(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if not torch.is_grad_enabled():
            return
        if module in self._recorded:  # a shared layer's per-example gradient is a sum of uses
            raise InvalidValue(f"book-keeping needs each layer used once per forward; {type(module).__name__} ran twice")
        if isinstance(module, nn.Linear) and inputs[0].dim() != 2:
            raise InvalidValue("book-keeping clips Linear layers on [n, d] rows only")
        self._recorded[module] = (inputs[0].detach(), output)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> "ClippedLoss":
        """Cross-entropy per example; its ``backward`` leaves the clipped sums in ``.grad``."""
        return ClippedLoss(self, F.cross_entropy(logits, targets, reduction="none"))

    def backward(self, per_example_losses: torch.Tensor) -> None:
        """Set ``.grad`` of every trainable parameter to Σ_b clip_C(∇ loss_b), an example whose loss
        or norm is not finite adding exactly 0."""
        if per_example_losses.dim() != 1:
            raise InvalidValue("book-keeping needs one loss per example")
        recorded, self._recorded = self._recorded, {}
        modules = [m for m in self.layers if m in recorded]
        if len(modules) != len(self.layers):
            raise InvalidValue("a trainable layer took no part in the forward pass")
        outputs = [recorded[m][1] for m in modules]
        # Gradients of the summed loss with respect to the layers' outputs only: autograd
        # skips the parameters' gradients, which the clipped sums below replace.
        output_grads = torch.autograd.grad(per_example_losses.sum(), outputs)
        norms_squared = torch.zeros(len(per_example_losses), device=per_example_losses.device)
        layer_grads = []
        for module, grad in zip(modules, output_grads):
            grads = LAYERS[type(module)](module, recorded[module][0], grad)
            if module.weight.requires_grad:
                norms_squared += grads.weight_norms_squared
            if _trains_bias(module):
                norms_squared += grads.bias.square().sum(1)
            layer_grads.append(grads)
        factors = torch.where(torch.isfinite(per_example_losses.detach()),
                              clip_factors(norms_squared.sqrt(), self.max_grad_norm), 0.0)  # Opacus's factor
        for module, grads in zip(modules, layer_grads):
            if module.weight.requires_grad:
                module.weight.grad = grads.weight_sum(factors).reshape(module.weight.shape)
            if _trains_bias(module):
                module.bias.grad = factors @ rows(grads.bias, factors > 0)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._recorded = {}


def _trains_bias(module: nn.Module) -> bool:
    return module.bias is not None and module.bias.requires_grad


@dataclass(frozen=True)
class ClippedLoss:
    """A batch's per-example losses, whose backward pass clips (the training loop's ``loss``)."""

    clipper: BookKeeping
    per_example: torch.Tensor

    def backward(self) -> None:
        self.clipper.backward(self.per_example)


def private_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, *, noise_multiplier: float,
                      max_grad_norm: float, expected_batch_size: float,
                      generator: torch.Generator | None = None) -> tuple[BookKeeping, DPOptimizerFastGradientClipping]:
    """The hooks that clip and the Opacus optimizer that adds N(0, σ²C²) to the clipped sum and
    divides by the expected batch: DP-SGD's step with book-keeping's clipping."""
    clipper = BookKeeping(model, max_grad_norm)
    dp_optimizer = DPOptimizerFastGradientClipping(
        optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
        expected_batch_size=expected_batch_size, loss_reduction="mean", generator=generator)
    return clipper, dp_optimizer


@dataclass(frozen=True)
class _LayerGrads:
    """One layer's per-example gradients, or what stands in for them."""

    weight_norms_squared: torch.Tensor  # [n]
    # clip factors [n] → Σ_b c_b ∇W_b, the rows of a factor 0 zeroed before they are summed
    weight_sum: Callable[[torch.Tensor], torch.Tensor]
    bias: torch.Tensor  # per-example bias gradients [n, out] (small: always formed)


def _linear(module: nn.Linear, inputs: torch.Tensor, grad: torch.Tensor) -> _LayerGrads:
    # ∇W_b = g_b a_bᵀ: its norm is ‖a_b‖‖g_b‖, and the clipped sum is one matmul.
    return _LayerGrads(inputs.square().sum(1) * grad.square().sum(1),
                       lambda factors: rows(grad * factors[:, None], factors > 0).t() @ rows(inputs, factors > 0),
                       grad)


def _conv2d(module: nn.Conv2d, inputs: torch.Tensor, grad: torch.Tensor) -> _LayerGrads:
    # ∇W_b = G_b U_bᵀ with U_b the input's patches [K, T] and G_b the output gradient [O, T].
    n, groups = len(inputs), module.groups
    flat = grad.flatten(2)
    out, positions = flat.shape[1:]
    taps = module.kernel_size[0] * module.kernel_size[1]
    k = module.in_channels // groups * taps
    padded_positions = (inputs.shape[2] + 2 * module.padding[0]) * (inputs.shape[3] + 2 * module.padding[1])
    # Multiply-adds per example: forming G_b U_bᵀ, against the two Gram matrices of the ghost norm.
    ghost_cost = padded_positions ** 2 * module.in_channels + positions ** 2 * (out + taps)
    if groups == 1 and ghost_cost < out * k * positions:
        def weight_sum(factors: torch.Tensor) -> torch.Tensor:
            # The clipped sum is the weight gradient of the output gradients scaled by the factors.
            kept = factors > 0
            return torch.ops.aten.convolution_backward(
                rows(grad * factors[:, None, None, None], kept), rows(inputs, kept), module.weight, None,
                module.stride, module.padding, module.dilation, False, [0, 0], groups, (False, True, False))[1]
        return _LayerGrads(_conv_ghost_norms_squared(module, inputs, grad), weight_sum, flat.sum(2))
    patches = F.unfold(inputs, module.kernel_size, module.dilation, module.padding, module.stride)
    per_example = torch.einsum("bgot,bgkt->bgok", flat.reshape(n, groups, out // groups, positions),
                               patches.reshape(n, groups, k, positions)).reshape(n, -1)
    return _LayerGrads(per_example.square().sum(1), lambda factors: factors @ rows(per_example, factors > 0),
                       flat.sum(2))


def _conv_ghost_norms_squared(module: nn.Conv2d, inputs: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """‖G_b U_bᵀ‖² = Σ (U_bᵀU_b) ⊙ (G_bᵀG_b) over [T, T] (ghost norm, Li et al. 2022), with U_bᵀU_b
    taken from the padded input's own Gram P_b = X_bᵀX_b (positions × positions, summed over
    channels): entry (t, t') of U_bᵀU_b sums P_b over the kernel's taps, each tap shifting both
    positions alike, so no patches are cut (im2col wrote 36 MB a step for ScatterNet)."""
    (pad_h, pad_w), (stride_h, stride_w), (dil_h, dil_w) = module.padding, module.stride, module.dilation
    padded = F.pad(inputs, (pad_w, pad_w, pad_h, pad_h))
    n, _, height, width = padded.shape
    flat = padded.flatten(2)
    gram = (flat.transpose(1, 2) @ flat).reshape(n, height, width, height, width)
    out_h, out_w = grad.shape[2:]
    patch_gram = torch.zeros(n, out_h, out_w, out_h, out_w, dtype=grad.dtype, device=grad.device)
    for i in range(module.kernel_size[0]):
        rows = slice(i * dil_h, i * dil_h + stride_h * (out_h - 1) + 1, stride_h)
        for j in range(module.kernel_size[1]):
            cols = slice(j * dil_w, j * dil_w + stride_w * (out_w - 1) + 1, stride_w)
            patch_gram += gram[:, rows, cols, rows, cols]
    output_grad = grad.flatten(2)
    return (patch_gram.flatten(3).flatten(1, 2) * (output_grad.transpose(1, 2) @ output_grad)).sum((1, 2))


def _group_norm(module: nn.GroupNorm, inputs: torch.Tensor, grad: torch.Tensor) -> _LayerGrads:
    # The affine parameters scale and shift the normalised input, channel by channel.
    n, channels = grad.shape[:2]
    normalised = F.group_norm(inputs, module.num_groups, eps=module.eps)
    per_example = (normalised * grad).reshape(n, channels, -1).sum(2)
    return _LayerGrads(per_example.square().sum(1), lambda factors: factors @ rows(per_example, factors > 0),
                       grad.reshape(n, channels, -1).sum(2))


# The layers book-keeping can clip: one function and one entry per layer type.
LAYERS: dict[type[nn.Module], Callable[[nn.Module, torch.Tensor, torch.Tensor], _LayerGrads]] = {
    nn.Linear: _linear, nn.Conv2d: _conv2d, nn.GroupNorm: _group_norm,
}
