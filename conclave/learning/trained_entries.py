"""Which entries of a model's parameters a DP-SGD step trains, laid out as one flat vector of d numbers.

Plain DP-SGD trains every entry; sparse fine-tuning (``learning.sparse``) trains some parameters
whole and others only inside a mask chosen on public data. Across owners the secure sum is over
exactly these d entries, parameter by parameter in the model's order, each one's entries in C order.
The coordinator and an owner's gateway agree on d and on that order from this object alone (it
travels as index lists: ``protos/owner.proto``'s ``TrainedEntries``). Per-example gradients are cut
to these entries before their norms are taken, so frozen entries add nothing to a norm, as
``learning.dpsgd.MaskedDPOptimizer`` does with 0/1 masks.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from conclave.errors import InvalidValue


@dataclass(frozen=True, eq=False)
class TrainedEntries:
    """Of the parameters of ``shapes`` (every parameter of a model, in its order), the trained ones:
    (parameter index, its flat entries strictly increasing, or None for all of them), by increasing
    index. ``ValueError`` (one line) when an index or entry lies past the shapes."""

    shapes: tuple[tuple[int, ...], ...]
    entries: tuple[tuple[int, np.ndarray | None], ...]

    def __post_init__(self) -> None:
        indices = [index for index, _ in self.entries]
        if not indices:
            raise InvalidValue("no parameter trains: name at least one")
        if any(b <= a for a, b in zip(indices, indices[1:])) or not 0 <= indices[0] or indices[-1] >= len(self.shapes):
            raise InvalidValue(f"trained parameters {indices[:8]} must be strictly increasing indices of the model's "
                             f"{len(self.shapes)} parameters")
        for index, flat in self.entries:
            if flat is None:
                continue
            size = math.prod(self.shapes[index])
            if flat.ndim != 1 or not len(flat):
                raise InvalidValue(f"parameter {index}: give its trained entries (flat indices), or none for all")
            if (np.diff(flat) <= 0).any() or flat[0] < 0 or flat[-1] >= size:
                raise InvalidValue(f"parameter {index}: its entries must be strictly increasing flat indices below its "
                                 f"{size} entries (shape {list(self.shapes[index])})")

    @classmethod
    def every(cls, model: nn.Module) -> TrainedEntries:
        """Every entry of every parameter (plain DP-SGD)."""
        shapes = tuple(tuple(p.shape) for p in model.parameters())
        return cls(shapes, tuple((index, None) for index in range(len(shapes))))

    @classmethod
    def of_masks(cls, model: nn.Module, masks: Mapping[str, torch.Tensor]) -> TrainedEntries:
        """The parameters with ``requires_grad``, each inside its 0/1 mask where ``masks`` has one
        (a ``learning.sparse.SparsePlan``'s)."""
        shapes, entries = [], []
        for index, (name, parameter) in enumerate(model.named_parameters()):
            shapes.append(tuple(parameter.shape))
            if parameter.requires_grad:
                mask = masks.get(name)
                flat = None if mask is None else np.flatnonzero(mask.detach().cpu().numpy().reshape(-1))
                entries.append((index, None if flat is None else flat.astype(np.int64)))
        return cls(tuple(shapes), tuple(entries))

    @property
    def dimension(self) -> int:
        """d: the entries a step trains."""
        return sum(math.prod(self.shapes[index]) if flat is None else len(flat) for index, flat in self.entries)

    @property
    def indices(self) -> tuple[int, ...]:
        """The trained parameters' indices."""
        return tuple(index for index, _ in self.entries)

    def gather(self, per_example: Sequence[torch.Tensor]) -> torch.Tensor:
        """[n, d]: each trained parameter's per-example gradients ``[n, *shape]`` (in ``indices``' order)
        cut to its trained entries, side by side."""
        parts = []
        for (_, flat), grads in zip(self.entries, per_example, strict=True):
            rows = grads.reshape(len(grads), -1)
            parts.append(rows if flat is None else rows[:, torch.from_numpy(flat).to(rows.device)])
        return torch.cat(parts, dim=1)

    def values(self, parameters: Sequence[torch.Tensor]) -> np.ndarray:
        """[d] float32: the trained entries' values of ``parameters`` (every parameter, in order)."""
        return self.gather([parameters[index].detach().cpu().reshape(1, -1) for index in self.indices]
                           ).reshape(-1).numpy().astype(np.float32)

    def write(self, parameters: Sequence[torch.Tensor], values: np.ndarray) -> None:
        """``values`` ([d], in this order) into the trained entries of ``parameters``; the others stay."""
        offset = 0
        with torch.no_grad():
            for index, flat in self.entries:
                target = parameters[index].view(-1)
                size = target.numel() if flat is None else len(flat)
                part = torch.tensor(values[offset:offset + size], dtype=target.dtype)
                if flat is None:
                    target.copy_(part)
                else:
                    target[torch.from_numpy(flat)] = part
                offset += size

    def set_gradients(self, parameters: Sequence[nn.Parameter], gradient: torch.Tensor) -> None:
        """``gradient`` ([d]) as the gradients of ``parameters``: exactly 0 at a trained parameter's
        frozen entries, None for a parameter that does not train (an optimizer leaves both as they are)."""
        trained = dict(self.entries)
        offset = 0
        for index, parameter in enumerate(parameters):
            if index not in trained:
                parameter.grad = None
                continue
            flat = trained[index]
            size = parameter.numel() if flat is None else len(flat)
            values = gradient[offset:offset + size].to(parameter.device, parameter.dtype)
            offset += size
            if flat is None:
                parameter.grad = values.view_as(parameter).clone()
            else:
                grad = torch.zeros(parameter.numel(), dtype=parameter.dtype, device=parameter.device)
                grad[torch.from_numpy(flat).to(parameter.device)] = values
                parameter.grad = grad.view_as(parameter)
