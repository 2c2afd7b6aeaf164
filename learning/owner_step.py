"""One owner's work at its gateway: DP-SGD steps, and what NearPrivate sums over its records.

A DP-SGD step is the clipped gradient sum of a padded Poisson batch of its records.

The coordinator sends weights (public); the owner loads them into its copy of a registered model,
draws a Poisson batch (rate q over its declared records, from OS entropy) padded to one public size
(``secure_dpsgd.PaddedPoissonBatches``: the same arithmetic whatever the draw) and sums the
per-example gradients clipped to C under ``finite_clipping``'s rule (a non-finite one adds exactly
0; padding rows have weight 0, so add 0 too). Per-example gradients come from ``torch.func`` (a vmap
of the gradient). The sum never leaves as it is: the caller quantizes, noises and masks it
(``privacy.secure_sum``).

``OwnerEmbeddings`` is NearPrivate's private side (``learning.embedding_stats``'s sums) under a DP
checkpoint's weights (public): each record embedded and scored on its own, over the declared records
(the rows padded with zeros), so that neither a value nor the time depends on another record.
"""
from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from conclave.learning.embedding_stats import covariance_sum, support_counts
from conclave.learning.finite_clipping import clip_factors, finite_losses, rows
from conclave.learning.secure_dpsgd import PaddedPoissonBatches
from conclave.learning.selection.entropy import logit_entropy
from conclave.learning.training import embed, predict_logits


def load_parameters(model: nn.Module, weights: Sequence[np.ndarray]) -> None:
    """``weights`` (every parameter of ``model``, in its order) into ``model``."""
    with torch.no_grad():
        for parameter, value in zip(model.parameters(), weights, strict=True):
            parameter.copy_(torch.tensor(value, dtype=torch.float32))


class OwnerSteps:
    """Steps on ``x``, ``y`` (the owner's records) with ``model``: at most ``steps`` Poisson batches
    at ``sample_rate`` over ``records`` (declared) draws, each clipped to ``max_grad_norm``."""

    def __init__(self, model: nn.Module, x: np.ndarray, y: np.ndarray, sample_rate: float, steps: int, records: int,
                 max_grad_norm: float) -> None:
        self.model, self.max_grad_norm = model, max_grad_norm
        self._names = [name for name, _ in model.named_parameters()]
        self.shapes = tuple(tuple(p.shape) for p in model.parameters())
        self.dimension = sum(p.numel() for p in model.parameters())
        generator = torch.Generator().manual_seed(secrets.randbits(63))
        self._batches = iter(PaddedPoissonBatches(torch.from_numpy(x), torch.from_numpy(y), sample_rate, steps,
                                                  records, generator))

    def clipped_sum(self, weights: Sequence[np.ndarray]) -> np.ndarray:
        """The next batch's clipped per-example gradient sum at ``weights`` (``shapes``, in order), flat."""
        load_parameters(self.model, weights)
        params = {name: p.detach() for name, p in self.model.named_parameters()}
        buffers = {name: b.detach() for name, b in self.model.named_buffers()}

        def loss(values: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = functional_call(self.model, (values, buffers), (x.unsqueeze(0),))
            return finite_losses(F.cross_entropy(logits, y.unsqueeze(0), reduction="none")).sum()

        per_example = vmap(grad(loss), in_dims=(None, 0, 0), randomness="different")
        total = torch.zeros(self.dimension, dtype=torch.float64)
        self.model.train()
        for x, y, weight in next(self._batches):
            grads = per_example(params, x, y)
            flat = torch.cat([grads[name].reshape(len(x), -1) for name in self._names], dim=1)
            factors = clip_factors(flat.norm(2, dim=1), self.max_grad_norm) * weight
            flat = rows(flat, factors > 0)  # a dropped or padding row adds exactly 0, NaN and inf included
            total += (factors.unsqueeze(1) * flat).sum(dim=0).double()
        return total.numpy()


class OwnerEmbeddings:
    """NearPrivate's sums over ``x`` (the owner's records) seen by ``model`` at a checkpoint's weights,
    the work done over ``records`` rows (declared; the rows past the held ones are zeros, discarded)."""

    def __init__(self, model: nn.Module, x: np.ndarray, records: int) -> None:
        self.model, self._held = model, len(x)
        padding = np.zeros((max(0, records - len(x)), *x.shape[1:]), dtype=x.dtype)
        self._x = np.concatenate([x, padding])
        self.model.eval()
        # d, fixed by the architecture: the width of the features of one zero input (public)
        self.dimension = int(embed(model, np.zeros((1, *x.shape[1:]), dtype=np.float32)).shape[1])

    def covariance(self, weights: Sequence[np.ndarray]) -> np.ndarray:
        """Σ x xᵀ of the held records' unit-normalised embeddings at ``weights`` (never leaves as it is)."""
        embeddings, _ = self._seen(weights)
        return covariance_sum(embeddings)

    def counts(self, weights: Sequence[np.ndarray], projection: np.ndarray, public_points: np.ndarray,
               threshold: float) -> np.ndarray:
        """Per public point, the held records with entropy ≥ ``threshold`` nearest to it once projected."""
        embeddings, entropy = self._seen(weights)
        return support_counts(embeddings, entropy, projection, public_points, threshold)

    def _seen(self, weights: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        load_parameters(self.model, weights)
        self.model.eval()
        # one record at a time: each row's embedding and entropy its own, bit for bit
        embeddings = embed(self.model, self._x, batch_size=1)[: self._held]
        entropy = logit_entropy(predict_logits(self.model, self._x, batch_size=1)[: self._held])
        return embeddings, entropy
