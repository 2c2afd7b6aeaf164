"""Semi-supervised training of the student: FixMatch (Sohn et al., NeurIPS 2020).

The student holds a few hundred labels released by the aggregator and thousands of public
inputs nobody labelled. FixMatch trains on both: the labelled images (weakly augmented) with
cross-entropy, and every unlabelled image whose weakly augmented view the model already
classifies with confidence ≥ ``threshold``, with cross-entropy of its *strongly* augmented
view against that guess. Only released labels and public inputs are used, so it is
post-processing: it costs no privacy.

The model may learn on a fixed representation of the images (``represent``, e.g. scattering):
augmentation acts on the images, then the representation is computed. A representation that
is expensive next to the model (scattering costs ~1 ms an image, the small networks on it far
less) is better computed once for ``views`` augmented copies of every image, from which each
step draws; with ``views=None`` every step augments and represents afresh.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from conclave.errors import InvalidValue

if TYPE_CHECKING:  # a config must load without torch; training imports it
    from torch import nn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FixMatchConfig:
    epochs: int = 20  # passes over the unlabelled images
    batch_size: int = 64  # labelled images per step
    unlabelled_ratio: int = 2  # μ: unlabelled images per labelled one in a step
    threshold: float = 0.95  # τ: confidence a weak view needs to become a pseudo-label
    unlabelled_weight: float = 1.0  # λ_u
    views: int | None = None  # augmented copies precomputed per image (None: fresh every step)
    lr: float = 0.03
    momentum: float = 0.9
    weight_decay: float = 5e-4
    seed: int = 0  # batch order and augmentations (public data only)
    # Draw labelled images class-balanced (each class equally often) rather than uniformly: answers
    # a screening mechanism let through can be mostly easy classes (kNN votes on MNIST: 89 ones, 1 five).
    balance_classes: bool = False
    # Keep an exponential moving average of the weights (decay per step) and end with it: the
    # average of the last few hundred steps is steadier than the last step's weights.
    ema_decay: float | None = None

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.unlabelled_ratio < 1:
            raise InvalidValue("epochs, batch_size and unlabelled_ratio must be >= 1")
        if not 0 < self.threshold <= 1:
            raise InvalidValue(f"threshold must be in (0, 1], got {self.threshold}")
        if not (self.lr > 0 and self.unlabelled_weight >= 0 and self.weight_decay >= 0 and 0 <= self.momentum < 1):
            raise InvalidValue("lr must be > 0, unlabelled_weight and weight_decay >= 0, momentum in [0, 1)")
        if self.views is not None and self.views < 1:
            raise InvalidValue(f"views must be >= 1 or None, got {self.views}")
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise InvalidValue(f"ema_decay must be in (0, 1) or None, got {self.ema_decay}")


Represent = Callable[[Any], Any]  # torch batch of images → the batch the model reads


def fixmatch(model: nn.Module, images: np.ndarray, labels: np.ndarray, unlabelled: np.ndarray,
             config: FixMatchConfig, represent: Represent | None = None, weak: Any = None,
             strong: Any = None, progress: bool = False) -> dict[str, float]:
    """Train ``model`` in place on labelled ``images``/``labels`` and ``unlabelled`` images
    (float32 ``[n, C, H, W]`` in [0, 1]), with ``weak``/``strong`` augmentations
    (``learning.augment.WEAK``/``STRONG`` by default). Returns what the training saw of the
    public data: the share of unlabelled views confident enough to be used, over the last epoch."""
    import torch
    from torch import nn
    from tqdm.auto import tqdm

    from conclave.learning.augment import STRONG, WEAK
    from conclave.learning.training import default_device

    weak, strong = weak or WEAK, strong or STRONG
    if len(images) == 0:
        raise InvalidValue("FixMatch needs at least one labelled image")
    if len(unlabelled) == 0:
        raise InvalidValue("FixMatch needs unlabelled images")
    represent = represent or (lambda batch: batch)
    generator = torch.Generator().manual_seed(config.seed)
    x_labelled, y_labelled = torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels.astype(np.int64))
    x_unlabelled = torch.from_numpy(np.ascontiguousarray(unlabelled))
    if config.views is not None:  # represent a few augmented copies once; each step draws one
        weak_labelled = _Views(x_labelled, weak, represent, config.views, generator)
        weak_unlabelled = _Views(x_unlabelled, weak, represent, config.views, generator)
        strong_unlabelled = _Views(x_unlabelled, strong, represent, config.views, generator)
    else:
        weak_labelled = _Fresh(x_labelled, weak, represent, generator)
        weak_unlabelled = _Fresh(x_unlabelled, weak, represent, generator)
        strong_unlabelled = _Fresh(x_unlabelled, strong, represent, generator)
    # The views stay in host memory (the batch order and augmentations are drawn there, from the
    # config's seed); each step's batch moves to the model's device, the GPU when one is visible.
    device = default_device()
    model.to(device)
    step_unlabelled = config.batch_size * config.unlabelled_ratio
    steps_per_epoch = max(1, math.ceil(len(x_unlabelled) / step_unlabelled))
    total_steps = config.epochs * steps_per_epoch
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum, nesterov=True,
                                weight_decay=config.weight_decay)
    # FixMatch's schedule: cos(7πk/16K), decaying to about a fifth of the rate
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: math.cos(7 * math.pi * k / (16 * total_steps)))
    cross_entropy = nn.CrossEntropyLoss()
    # Balanced: each labelled image is drawn with weight 1/(its class's count), so classes alike.
    balanced = 1.0 / torch.bincount(y_labelled)[y_labelled].double() if config.balance_classes else None
    average = (torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(config.ema_decay), use_buffers=True)
        if config.ema_decay is not None else None)
    model.train()
    used = seen = 0
    for epoch in tqdm(range(config.epochs), desc="FixMatch", unit="epoch", disable=not progress):
        used = seen = 0
        order = torch.randperm(len(x_unlabelled), generator=generator)
        for step in range(steps_per_epoch):
            batch_u = order[step * step_unlabelled:(step + 1) * step_unlabelled]
            picked = (torch.multinomial(balanced, config.batch_size, replacement=True, generator=generator)
                      if balanced is not None else
                      torch.randint(0, len(x_labelled), (config.batch_size,), generator=generator))
            loss = cross_entropy(model(weak_labelled(picked).to(device)), y_labelled[picked].to(device))
            with torch.no_grad():
                probabilities = torch.softmax(model(weak_unlabelled(batch_u).to(device)), dim=1)
                confidence, guess = probabilities.max(dim=1)
                mask = (confidence >= config.threshold).float()
            if mask.any():
                per_example = nn.functional.cross_entropy(model(strong_unlabelled(batch_u).to(device)), guess, reduction="none")
                loss = loss + config.unlabelled_weight * (per_example * mask).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if average is not None:
                average.update_parameters(model)
            used += int(mask.sum())
            seen += len(batch_u)
    if average is not None:
        model.load_state_dict(average.module.state_dict())
    model.eval()
    share = used / seen if seen else 0.0
    log.debug("FixMatch: %d steps, %.2f of the unlabelled views used in the last epoch", total_steps, share)
    return {"steps": float(total_steps), "unlabelled_used_last_epoch": share}


class _Fresh:
    """Augment and represent the chosen images at every call."""

    def __init__(self, images, augment, represent, generator) -> None:
        self.images, self.augment, self.represent, self.generator = images, augment, represent, generator

    def __call__(self, indices):
        return self.represent(self.augment(self.images[indices], self.generator))


class _Views:
    """``count`` augmented, represented copies of every image, computed once; each call draws one per image."""

    def __init__(self, images, augment, represent, count: int, generator, chunk: int = 1000) -> None:
        import torch

        self.generator = generator
        with torch.no_grad():
            self.views = torch.stack([
                torch.cat([represent(augment(images[start:start + chunk], generator))
                           for start in range(0, len(images), chunk)])
                for _ in range(count)])  # [count, n, ...]

    def __call__(self, indices):
        import torch

        copy = torch.randint(0, len(self.views), (len(indices),), generator=self.generator)
        return self.views[copy, indices]
