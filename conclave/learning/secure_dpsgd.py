"""Data-parallel DP-SGD across owners through secure aggregation: no rank sees another's sum.

Each rank clips its Poisson batch's per-example gradients and sends its sum only as a masked
share of a secure sum with Skellam noise (``privacy.secure_sum``), instead of Opacus's clean
all-reduce, which would show every rank the others' exact sums. Every step computes on a padded
batch of one public size (``PaddedPoissonBatches``), so a rank's arrival at the all-reduce does
not depend on its records. The charge, free of d: docs/privacy.md, "Secure DP-SGD's charge".
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from conclave.errors import InvalidValue
from conclave.learning.finite_clipping import FiniteDPOptimizer
from conclave.privacy.accounting.skellam import skellam_charge
from conclave.privacy.noise import NoiseSource
from conclave.privacy.secure_release import release_plan
from conclave.privacy.secure_sum import (DOMINATING_SENSITIVITY, MaskKeys, SecureSumPlan, decode, masked_share, quantize,
                                skellam_noise)


@dataclass(frozen=True)
class SecureGroup:
    """One rank's part in a secure sum: each rank's owner (public), this rank's key pair (its
    private key never leaves the process) and every rank's public key, in rank order."""

    owners: tuple[str, ...]
    keys: MaskKeys
    public_keys: tuple[bytes, ...]


@dataclass(frozen=True)
class SecureAggregation:
    """Who takes part in a secure sum (public): ``owners[rank]`` is the owner of each rank,
    ``dimension`` the entries trained (the model's trainable parameters, inside their masks)."""

    owners: tuple[str, ...]
    dimension: int

    def __post_init__(self) -> None:
        if not self.owners or self.dimension < 1:
            raise InvalidValue(f"a secure sum needs ranks and a dimension, got {len(self.owners)} ranks, "
                             f"d = {self.dimension}")

    def plan(self, max_grad_norm: float, noise_multiplier: float, num_examples: int, steps: int) -> SecureSumPlan:
        """The ring, scale and noise of every step, from public numbers only, refused if a step
        would cost more than ``dp_schedule.secure_charge`` assumes. A rank's clipped sum has norm ≤ C·(its
        batch); the ball of C·N (N declared) leaves it untouched unless the rank holds more
        records than the whole run declared."""
        bound = DOMINATING_SENSITIVITY
        return release_plan(skellam_charge(bound, bound, (noise_multiplier * bound) ** 2),
                            dimension=self.dimension, owners=self.owners, norm_bound=max_grad_norm * num_examples,
                            noise_multiplier=noise_multiplier, integer_inputs=False, what="secure DP-SGD",
                            sensitivity=max_grad_norm, rounds=max(steps, 1))


OVERFLOW = 1e-9  # the chance per step that a rank's Poisson batch passes its padded size


def row_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` with row-major strides. A one-channel image array viewed from numpy carries strides
    torch reads as channels_last (a size-1 dimension's stride is free), every convolution then
    runs channels_last, and Opacus's per-example gradients of each convolution after the first
    come out wrong (each still reads its own example only, so the privacy holds, not the training)."""
    strides = tuple(math.prod(x.shape[i + 1:]) for i in range(x.dim()))
    return x if x.stride() == strides else x.clone(memory_format=torch.contiguous_format)


def padded_batch_size(records: int, sample_rate: float, overflow: float = OVERFLOW) -> int:
    """The rows each step of a rank computes on: a Poisson batch of ``records`` examples (public:
    declared) at rate ``sample_rate`` passes it with probability at most ``overflow``."""
    from scipy.stats import binom

    return max(1, int(binom.isf(overflow, records, sample_rate)))


class PaddedPoissonBatches:
    """One rank's Poisson batches for ``steps`` steps, each as the same number of chunks of
    ``rows`` (≤ ``max_rows``) inputs, labels and weights: the sampled examples (weight 1), then
    padding rows (index 0, weight 0). Each example is included with probability ``sample_rate``,
    drawn from ``generator``; the draws cover ``records`` (public, declared) entries, of which
    the examples held are the first, so neither their cost nor the batch's shape depends on how
    many are held (module docstring, Timing)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, sample_rate: float, steps: int, records: int,
                 generator: torch.Generator, max_rows: int | None = None) -> None:
        if len(x) != len(y):
            raise InvalidValue(f"dataset needs matching x and y (got {len(x)} and {len(y)})")
        self.held = len(y)
        if not self.held:  # a zero row to pad with, never sampled
            x, y = torch.zeros((1, *x.shape[1:])), torch.zeros(1, dtype=torch.long)
        self.x, self.y = row_major(x), y
        self.sample_rate, self.steps, self.generator = sample_rate, steps, generator
        self.draws = max(records, self.held)
        padded = padded_batch_size(records, sample_rate)
        self.rows = min(padded, max_rows) if max_rows else padded
        self.chunks = math.ceil(padded / self.rows)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        for _ in range(self.steps):
            included = torch.rand(self.draws, generator=self.generator) < self.sample_rate
            included[self.held:] = False
            chosen = included.nonzero().flatten()
            chunks = max(self.chunks, math.ceil(len(chosen) / self.rows))  # more only past the padded size
            index = torch.zeros(chunks * self.rows, dtype=torch.long)
            weight = torch.zeros(chunks * self.rows)
            index[:len(chosen)], weight[:len(chosen)] = chosen, 1.0
            x, y = self.x[index], self.y[index]
            yield [(x[i:i + self.rows], y[i:i + self.rows], weight[i:i + self.rows])
                   for i in range(0, len(index), self.rows)]


def trainable_entries(model: nn.Module, masks: dict[str, torch.Tensor]) -> int:
    """How many numbers a step updates: every trainable parameter's entries, inside its mask."""
    total = 0
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            mask = masks.get(name)
            total += int(mask.sum().item()) if mask is not None else parameter.numel()
    return total


def broadcast_parameters(model: nn.Module) -> None:
    """Every rank starts from rank 0's weights and buffers (public: built from the run's seed)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)


class SecureSumDPOptimizer(FiniteDPOptimizer):
    """Flat clipping (``FiniteDPOptimizer``: an example whose gradient is not finite adds exactly 0)
    whose noise step is one round of the secure sum (module docstring).

    ``masks`` (parameter → 0/1 tensor) restrict training element by element: applied to the
    per-example gradients before clipping, and only the entries inside them are summed.
    ``expected_batch_size`` must be the whole group's (q·N), since the total is not averaged.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, group: SecureGroup, aggregation: SecureAggregation,
                 plan: SecureSumPlan, noise: NoiseSource, session: str,
                 masks: dict[nn.Parameter, torch.Tensor] | None = None, **kwargs) -> None:
        super().__init__(optimizer, **kwargs)
        self._rank = dist.get_rank()
        if dist.get_world_size() != len(aggregation.owners) or group.keys.rank != self._rank:
            raise InvalidValue(f"the gloo group (rank {self._rank} of {dist.get_world_size()}) is not the secure "
                             f"sum's ({group.keys.rank} of {len(aggregation.owners)})")
        self._plan, self._noise = plan, noise
        self._variance = plan.party_variances(aggregation.owners)[self._rank]
        masks = masks or {}
        self._masks = {id(p): masks[p].to(device=p.device, dtype=torch.bool) for p in masks}
        if sum(self._size(p) for p in self.params) != plan.dimension:
            raise InvalidValue("the trained entries differ from the plan's dimension")
        self._pairwise = group.keys.pairwise_masks(list(group.public_keys), session)
        self._round = 0

    def _size(self, p: nn.Parameter) -> int:
        mask = self._masks.get(id(p))
        return int(mask.sum().item()) if mask is not None else p.numel()

    def clip_and_accumulate(self) -> None:
        for p in self.params:
            mask = self._masks.get(id(p))
            if mask is not None and getattr(p, "grad_sample", None) is not None:
                for g in p.grad_sample if isinstance(p.grad_sample, list) else [p.grad_sample]:
                    g.masked_fill_(~mask, 0.0)  # before the per-example norms: frozen entries add nothing
        super().clip_and_accumulate()

    def add_noise(self) -> None:
        """One round: this rank's clipped sum → masked share → all-reduce → the noised total."""
        parts = []
        for p in self.params:
            mask = self._masks.get(id(p))
            summed = p.summed_grad.detach().reshape(-1)
            parts.append(summed[mask.reshape(-1)] if mask is not None else summed)
        local = torch.cat(parts).cpu().double().numpy()
        self._round += 1
        noise = skellam_noise(self._plan.dimension, self._variance, self._noise)
        share = torch.from_numpy(masked_share(quantize(local, self._plan), noise, self._pairwise, self._plan,
                                              self._round))
        dist.all_reduce(share, op=dist.ReduceOp.SUM)  # W·m < 2^63: no overflow before the reduction mod m
        total = torch.from_numpy(decode(share.numpy(), self._plan))
        offset = 0
        for p in self.params:
            mask = self._masks.get(id(p))
            size = self._size(p)
            values = total[offset:offset + size].to(device=p.device, dtype=p.dtype)
            offset += size
            if mask is None:
                p.grad = values.view_as(p).clone()
            else:
                grad = torch.zeros_like(p)
                grad[mask] = values
                p.grad = grad
            p.summed_grad = None  # nothing of this rank's clean sum outlives the round
