"""Max-pooling that is cheap at inference.

PyTorch's CPU max-pool computes the argmax indices (for the backward pass) even under
``no_grad``; for the tutorial CNN's 2×2 stride-1 pools that was over half of a teacher's
inference time. Without gradients this module takes the maximum over shifted strided views
instead: the same values exactly (a maximum has no rounding), a few vectorised passes, no
indices. With gradients it is ``nn.MaxPool2d``, so training and Opacus see the usual layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from conclave.errors import InvalidValue


class MaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` (square kernel, no padding, dilation or ceil mode) with an index-free
    inference path."""

    def __init__(self, kernel_size: int, stride: int | None = None) -> None:
        super().__init__(kernel_size, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return F.max_pool2d(x, self.kernel_size, self.stride)
        rows = window_max(x, x.dim() - 2, self.kernel_size, self.stride)
        return window_max(rows, x.dim() - 1, self.kernel_size, self.stride)


def window_max(x: torch.Tensor, dim: int, kernel: int, stride: int) -> torch.Tensor:
    """Maximum over windows of ``kernel`` along ``dim``, one every ``stride``: one pass per offset."""
    windows = (x.shape[dim] - kernel) // stride + 1
    if windows < 1:
        raise InvalidValue(f"max-pool kernel {kernel} is larger than the input ({x.shape[dim]})")
    index = [slice(None)] * x.dim()

    def shifted(offset: int) -> torch.Tensor:
        index[dim] = slice(offset, offset + stride * (windows - 1) + 1, stride)
        return x[tuple(index)]

    result = shifted(0)
    for offset in range(1, kernel):
        result = torch.maximum(result, shifted(offset))
    return result
