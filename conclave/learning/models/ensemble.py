"""Many models of one architecture asked about the same inputs at once: the teachers' votes.

Every teacher sees the same inputs, so patches are cut once and each block of teachers runs as
one wide network (one matmul, grouped convolutions, batched Linears): model by model the first
convolution ran at an eighth of the machine's FLOP rate. The classes predicted are the models'
own; architectures with other layers are not stacked (``StackedEnsemble.of`` answers None).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from conclave.errors import InvalidValue
from conclave.learning.models.pooling import window_max

IN_PLACE_ACTIVATIONS: dict[type[nn.Module], object] = {nn.ReLU: torch.relu_, nn.Tanh: torch.tanh_}


def layers_of(model: nn.Module) -> list[nn.Module] | None:
    """The model as a flat list of layers applied in order, or None when it is not one."""
    if isinstance(model, nn.Sequential):
        parts: list[nn.Module] = list(model)
    elif hasattr(model, "body") and hasattr(model, "classifier"):  # cnn.FeatureClassifier
        if not isinstance(model.body, nn.Sequential):
            return None
        parts = [*model.body, model.classifier]
    else:
        return None
    return parts if all(_supported(layer) for layer in parts) else None


def _supported(layer: nn.Module) -> bool:
    if isinstance(layer, nn.Conv2d):
        return layer.padding_mode == "zeros" and isinstance(layer.padding, tuple)
    if isinstance(layer, nn.MaxPool2d):  # ours or torch's, without padding, dilation or ceil mode
        return (isinstance(layer.kernel_size, int) and isinstance(layer.stride, int) and layer.padding == 0
                and layer.dilation == 1 and not layer.ceil_mode)
    if isinstance(layer, nn.Flatten):
        return layer.start_dim == 1 and layer.end_dim == -1
    return type(layer) in (nn.Linear, *IN_PLACE_ACTIVATIONS)


def _same_layer(a: nn.Module, b: nn.Module) -> bool:
    same_shapes = all(p.shape == q.shape for p, q in zip(a.parameters(), b.parameters()))
    return type(a) is type(b) and a.extra_repr() == b.extra_repr() and same_shapes


def stackable(models: Sequence[nn.Module]) -> bool:
    """Whether ``StackedEnsemble`` can run these models: supported layers only, one architecture,
    and a first weighted layer that is a Linear or an ungrouped Conv2d (its input is shared)."""
    layers = [layers_of(model) for model in models]
    if not models or any(stack is None for stack in layers):
        return False
    if len({parameter.device for model in models for parameter in model.parameters()}) != 1:
        return False  # e.g. on a GPU, a teacher whose empty shard left it untrained on the CPU
    first = layers[0]
    if any(len(stack) != len(first) or not all(map(_same_layer, stack, first)) for stack in layers):
        return False
    opening = next((layer for layer in first if not isinstance(layer, nn.Flatten)), None)
    return isinstance(opening, nn.Linear) or (isinstance(opening, nn.Conv2d) and opening.groups == 1)


@dataclass(frozen=True)
class _Block:
    """One block's layers with their teachers' parameters stacked."""

    layers: list[nn.Module]       # the first teacher's, for the hyperparameters
    weights: list[torch.Tensor | None]
    biases: list[torch.Tensor | None]
    size: int


class StackedEnsemble:
    """Predicted classes of several models of one architecture, computed block by block.

    Build it with ``of`` once the models are trained: it copies their weights, so later
    changes to the models are not seen.
    """

    def __init__(self, models: Sequence[nn.Module], block: int = 4, chunk: int = 64) -> None:
        if not stackable(models):
            raise InvalidValue("these models cannot be stacked; StackedEnsemble.of answers None for them")
        if block < 1 or chunk < 1:
            raise InvalidValue(f"block and chunk must be >= 1, got {block} and {chunk}")
        self._layers = [_pool_before_relu(layers_of(model)) for model in models]
        self.num_models = len(models)
        self.block = block
        self.chunk = chunk
        self.device = next(models[0].parameters()).device
        self._blocks: dict[int, list[_Block]] = {}  # by block size, stacked on first use

    @classmethod
    def of(cls, models: Sequence[nn.Module], block: int = 4, chunk: int = 64) -> "StackedEnsemble | None":
        """The stacked ensemble, or None when ``stackable(models)`` is false."""
        return cls(models, block, chunk) if stackable(models) else None

    def _blocks_of(self, size: int) -> list[_Block]:
        if size not in self._blocks:
            with torch.no_grad():
                self._blocks[size] = [self._stack(self._layers[start:start + size])
                                      for start in range(0, self.num_models, size)]
        return self._blocks[size]

    def _block_size(self, inputs: int) -> int:
        """The widest of the block sizes whose block × ``inputs`` stays within block × chunk."""
        fits = max(self.block, self.block * self.chunk // inputs)
        return min(self.num_models, max(size for size in (self.block, 4 * self.block, self.num_models) if size <= fits))

    @staticmethod
    def _stack(teachers: list[list[nn.Module]]) -> _Block:
        weights: list[torch.Tensor | None] = []
        biases: list[torch.Tensor | None] = []
        first_weighted = True
        for position, layer in enumerate(teachers[0]):
            same = [stack[position] for stack in teachers]
            if isinstance(layer, nn.Conv2d) and first_weighted:  # [C·kh·kw, block·out], im2col's order
                weights.append(torch.cat([m.weight.reshape(m.out_channels, -1).t() for m in same], 1).contiguous())
            elif isinstance(layer, nn.Conv2d):  # a grouped convolution's filters, channels-last
                weights.append(torch.cat([m.weight for m in same]).contiguous(memory_format=torch.channels_last))
            elif isinstance(layer, nn.Linear) and first_weighted:  # [in, block·out]
                weights.append(torch.cat([m.weight.t() for m in same], 1).contiguous())
            elif isinstance(layer, nn.Linear):  # [block, in, out]
                weights.append(torch.stack([m.weight.t() for m in same]).contiguous())
            else:
                weights.append(None)
                biases.append(None)
                continue
            bias = [m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in same]
            biases.append(torch.cat(bias) if first_weighted or isinstance(layer, nn.Conv2d)
                          else torch.stack(bias)[:, None, :])
            first_weighted = False
        return _Block(teachers[0], weights, biases, len(teachers))

    def predict(self, inputs: torch.Tensor | np.ndarray) -> np.ndarray:
        """int64 [models, n]: each model's predicted class for every input."""
        x = torch.as_tensor(np.ascontiguousarray(inputs, dtype=np.float32)).to(self.device)
        if len(x) == 0:
            raise InvalidValue("inputs are empty")
        out = torch.empty((self.num_models, len(x)), dtype=torch.int64)
        with torch.no_grad():
            for start in range(0, len(x), self.chunk):
                batch = x[start:start + self.chunk]
                patches = self._patches(batch)
                row = 0
                for block in self._blocks_of(self._block_size(len(batch))):
                    logits = self._run(block, batch, patches)  # [block, n, k]
                    out[row:row + block.size, start:start + len(batch)] = logits.argmax(-1).cpu()
                    row += block.size
        return out.numpy()

    def _patches(self, batch: torch.Tensor) -> torch.Tensor | None:
        """The first convolution's im2col [n·oh·ow, C·kh·kw], shared by every block."""
        conv = next((layer for layer in self._layers[0] if isinstance(layer, (nn.Conv2d, nn.Linear))))
        if not isinstance(conv, nn.Conv2d):
            return None
        columns = F.unfold(batch, conv.kernel_size, conv.dilation, conv.padding, conv.stride)  # [n, C·k·k, L]
        return columns.transpose(1, 2).reshape(-1, columns.shape[1])

    @staticmethod
    def _run(block: _Block, batch: torch.Tensor, patches: torch.Tensor | None) -> torch.Tensor:
        # The state is an image [n, H, W, block·C] (channels-last, teachers side by side) or
        # vectors [block, n, F]; before the first weighted layer it is the shared input.
        n, g = len(batch), block.size
        state, shared = batch, True
        for position, (layer, weight, bias) in enumerate(zip(block.layers, block.weights, block.biases)):
            if isinstance(layer, nn.Conv2d) and shared:
                height, width = (_out_size(batch.shape[2 + d], layer, d) for d in (0, 1))
                state = torch.addmm(bias, patches, weight).view(n, height, width, -1)
            elif isinstance(layer, nn.Conv2d):
                state = F.conv2d(state.permute(0, 3, 1, 2), weight, bias, layer.stride, layer.padding,
                                 layer.dilation, layer.groups * g).permute(0, 2, 3, 1)
            elif isinstance(layer, nn.Linear) and shared:  # [n, in] @ [in, block·out] → [block, n, out]
                state = torch.addmm(bias, state, weight).view(n, g, -1).transpose(0, 1)
            elif isinstance(layer, nn.Linear):
                state = torch.baddbmm(bias, state, weight)
            elif isinstance(layer, nn.MaxPool2d):
                for dim in (1, 2):
                    kept = _pool_rows_read(block.layers, position, state.shape[dim], dim - 1)
                    state = window_max(state.narrow(dim, 0, kept), dim, layer.kernel_size, layer.stride)
            elif isinstance(layer, nn.Flatten):
                if not shared:  # [n, H, W, block·C] → [block, n, C·H·W], torch's flattening order
                    height, width = state.shape[1:3]
                    state = state.reshape(n, height, width, g, -1).permute(3, 0, 4, 1, 2).reshape(g, n, -1)
                else:
                    state = state.flatten(1)
                continue
            else:  # an activation, in place on the block's own tensor
                state = IN_PLACE_ACTIVATIONS[type(layer)](state)
                continue
            shared = False
        return state


def _pool_before_relu(layers: list[nn.Module]) -> list[nn.Module]:
    """ReLU then max-pool as max-pool then ReLU: the same values exactly (ReLU is monotone and
    exact), and the ReLU pass is over the smaller, freshly written tensor."""
    layers = list(layers)
    for i in range(len(layers) - 1):
        if isinstance(layers[i], nn.ReLU) and isinstance(layers[i + 1], nn.MaxPool2d):
            layers[i], layers[i + 1] = layers[i + 1], layers[i]
    return layers


def _pool_rows_read(layers: list[nn.Module], position: int, size: int, dim: int) -> int:
    """How many of the ``size`` input rows (along ``dim`` of H, W) the max-pool at ``position``
    needs: fewer than all when the next convolution (unpadded, strided) skips the last rows."""
    pool = layers[position]
    pooled = (size - pool.kernel_size) // pool.stride + 1
    following = next((layer for layer in layers[position + 1:] if type(layer) not in IN_PLACE_ACTIVATIONS), None)
    if not isinstance(following, nn.Conv2d) or following.padding[dim] != 0:
        return size
    read = (_out_size(pooled, following, dim) - 1) * following.stride[dim] \
        + following.dilation[dim] * (following.kernel_size[dim] - 1) + 1
    return (read - 1) * pool.stride + pool.kernel_size


def _out_size(size: int, conv: nn.Conv2d, dim: int) -> int:
    span = conv.dilation[dim] * (conv.kernel_size[dim] - 1) + 1
    return (size + 2 * conv.padding[dim] - span) // conv.stride[dim] + 1
