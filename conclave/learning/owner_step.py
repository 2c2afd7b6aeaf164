"""One owner's work at its gateway: DP-SGD steps, and what NearPrivate sums over its records.

A DP-SGD step is the clipped gradient sum of a padded Poisson batch of its records.

The coordinator sends weights (public); the owner loads them into its copy of a registered model,
draws a Poisson batch (rate q over its declared records, from OS entropy) padded to one public size
(``secure_dpsgd.PaddedPoissonBatches``: the same arithmetic whatever the draw) and sums the
per-example gradients clipped to C under ``finite_clipping``'s rule (a non-finite one adds exactly
0; padding rows have weight 0, so add 0 too). Per-example gradients come from ``torch.func`` (a vmap
of the gradient). A sparse fine-tuning trains only some entries (``learning.trained_entries``): the
gradients are taken for the trained parameters alone and cut to their trained entries before the
norms, so the sum has d entries and frozen ones add nothing to a norm. The sum never leaves as it
is: the caller quantizes, noises and masks it (``privacy.secure_sum``).

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

from conclave.errors import InvalidValue
from conclave.learning.embedding_stats import covariance_sum, support_counts
from conclave.learning.finite_clipping import clip_factors, finite_losses, rows
from conclave.learning.secure_dpsgd import PaddedPoissonBatches
from conclave.learning.selection.entropy import logit_entropy
from conclave.learning.trained_entries import TrainedEntries
from conclave.learning.training import embed, predict_logits


def load_parameters(model: nn.Module, weights: Sequence[np.ndarray]) -> None:
    """``weights`` (every parameter of ``model``, in its order) into ``model``."""
    with torch.no_grad():
        for parameter, value in zip(model.parameters(), weights, strict=True):
            parameter.copy_(torch.tensor(value, dtype=torch.float32))


class OwnerSteps:
    """Steps on ``x``, ``y`` (the owner's records) with ``model``: at most ``steps`` Poisson batches
    at ``sample_rate`` over ``records`` (declared) draws, each clipped to ``max_grad_norm``, of the
    gradients of the ``trained`` entries (None: every entry of every parameter)."""

    def __init__(self, model: nn.Module, x: np.ndarray, y: np.ndarray, sample_rate: float, steps: int, records: int,
                 max_grad_norm: float, trained: TrainedEntries | None = None) -> None:
        self.model, self.max_grad_norm = model, max_grad_norm
        self.trained = trained or TrainedEntries.every(model)
        self._names = [name for name, _ in model.named_parameters()]
        self.shapes = tuple(tuple(p.shape) for p in model.parameters())
        if self.trained.shapes != self.shapes:
            raise InvalidValue("the trained entries are of another model's parameters")
        self.dimension = self.trained.dimension
        generator = torch.Generator().manual_seed(secrets.randbits(63))
        self._batches = iter(PaddedPoissonBatches(torch.from_numpy(x), torch.from_numpy(y), sample_rate, steps,
                                                  records, generator))

    def clipped_sum(self, weights: Sequence[np.ndarray]) -> np.ndarray:
        """The next batch's clipped per-example gradient sum at ``weights`` (``shapes``, in order), flat [d]."""
        load_parameters(self.model, weights)
        return self._clipped_sum()

    def clipped_sum_at(self, trained: np.ndarray) -> np.ndarray:
        """The same with only the trained entries' values sent ([d]); every other entry as loaded before
        (a sparse run's public pre-trained weights)."""
        self.trained.write(list(self.model.parameters()), trained)
        return self._clipped_sum()

    def _clipped_sum(self) -> np.ndarray:
        params = {name: p.detach() for name, p in self.model.named_parameters()}
        buffers = {name: b.detach() for name, b in self.model.named_buffers()}
        trained = [self._names[index] for index in self.trained.indices]
        frozen = {name: value for name, value in params.items() if name not in trained}

        def loss(values: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = functional_call(self.model, (values, frozen, buffers), (x.unsqueeze(0),))
            return finite_losses(F.cross_entropy(logits, y.unsqueeze(0), reduction="none")).sum()

        per_example = vmap(grad(loss), in_dims=(None, 0, 0), randomness="different")
        total = torch.zeros(self.dimension, dtype=torch.float64)
        self.model.train()
        for x, y, weight in next(self._batches):
            grads = per_example({name: params[name] for name in trained}, x, y)
            flat = self.trained.gather([grads[name] for name in trained])  # frozen entries: not in any norm
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
