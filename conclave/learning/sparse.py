"""Which weights a private fine-tuning may touch (Luo et al. 2021, "Scalable differential
privacy with sparse network finetuning").

A network pre-trained on public data is transferred to a private task. DP-SGD noise grows
with the number of trained entries while each example's clipped gradient does not, so the
paper trains only a few: a new classifier, the normalisation parameters, and the p% of
convolution weights with the largest magnitude *in the public model* (chosen before any
private data is seen, so the choice costs no privacy).

Variants (the paper's ablation, Table 3, plus the whole-network baseline):
  "classifier"       the new classifier only (vanilla transfer learning)
  "classifier+norm"  + every GroupNorm weight and bias
  "all"              + the masked convolution weights (the paper's method)
  "whole"            every parameter (plain DP-SGD fine-tuning)

Other parameters (e.g. extra Linear layers of a CNN) train only in "whole".
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
from opacus import GradSampleModule
from torch import nn

from conclave.errors import InvalidValue
from conclave.learning.data import Dataset, load_dataset
from conclave.learning.sparse_variants import VARIANTS

GROUPS = ("conv", "norm", "classifier", "other")


def parameter_groups(model: nn.Module) -> dict[str, str]:
    """Parameter name → "conv" (Conv2d weight), "norm" (GroupNorm), "classifier" or "other"."""
    if not isinstance(getattr(model, "classifier", None), nn.Linear):
        raise InvalidValue("the model needs a `.classifier` nn.Linear (the layer replaced for the new task)")
    classifier = {id(p) for p in model.classifier.parameters()}
    kinds: dict[int, str] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if isinstance(module, nn.GroupNorm):
                kinds[id(p)] = "norm"
            elif isinstance(module, nn.Conv2d) and p is module.weight:
                kinds[id(p)] = "conv"
    return {
        name: "classifier" if id(p) in classifier else kinds.get(id(p), "other")
        for name, p in model.named_parameters()
    }


def select_classes(dataset: Dataset, classes: tuple[int, ...], name: str | None = None) -> Dataset:
    """The examples of ``classes``, relabelled 0..k-1 in the given order (a transfer task such
    as MNIST digits 5–9 → five new classes)."""
    if not classes or len(set(classes)) != len(classes):
        raise InvalidValue(f"classes must be distinct and non-empty, got {classes}")
    if any(not 0 <= c < dataset.num_classes for c in classes):
        raise InvalidValue(f"classes must lie in [0, {dataset.num_classes}) for {dataset.name}, got {classes}")
    lookup = np.full(dataset.num_classes, -1, dtype=np.int64)
    lookup[list(classes)] = np.arange(len(classes))
    keep = np.flatnonzero(lookup[dataset.y] >= 0)
    label = name or f"{dataset.name}[{','.join(map(str, classes))}]"
    return Dataset(dataset.x[keep], lookup[dataset.y[keep]], len(classes), label)


def transfer_split(
    dataset: str, root: str | None, classes: tuple[int, ...] = (), size: int | None = None, seed: int = 0
) -> tuple[Dataset, Dataset]:
    """(train, test) of ``dataset`` restricted to ``classes`` (all when empty), the training
    split optionally cut to a seeded subsample of ``size`` (same seed → same examples)."""
    train, test = load_dataset(dataset, root)
    if classes:
        train, test = select_classes(train, classes), select_classes(test, classes)
    if size is not None and size < len(train):
        train = train.subset(np.sort(np.random.default_rng(seed).choice(len(train), size, replace=False)))
    return train, test


def replace_classifier(model: nn.Module, num_classes: int, seed: int = 0) -> nn.Module:
    """Swap ``model.classifier`` for a freshly initialised Linear with ``num_classes`` outputs."""
    old = model.classifier
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.classifier = nn.Linear(old.in_features, num_classes)
    return model


def magnitude_masks(model: nn.Module, fraction: float) -> dict[str, torch.Tensor]:
    """0/1 masks selecting the ``fraction`` (0 < fraction ≤ 1) of all convolution weights with
    the largest |w|, one global threshold across layers as in the paper (|θ̂| = p|θ|).

    Exactly ceil(fraction · total) entries are selected (ties broken by position). Layers
    with no selected entry are left out of the result.
    """
    if not 0 < fraction <= 1:
        raise InvalidValue(f"fraction must be in (0, 1], got {fraction}")
    groups = parameter_groups(model)
    convs = {name: p.detach() for name, p in model.named_parameters() if groups[name] == "conv"}
    if not convs:
        raise InvalidValue("the model has no convolution weights to mask")
    flat = torch.cat([p.abs().flatten() for p in convs.values()])
    keep = math.ceil(fraction * flat.numel())
    chosen = torch.zeros(flat.numel(), dtype=torch.bool)
    chosen[torch.topk(flat, keep, sorted=False).indices] = True
    masks, start = {}, 0
    for name, p in convs.items():
        part = chosen[start:start + p.numel()].reshape(p.shape)
        start += p.numel()
        if part.any():
            masks[name] = part.to(p.dtype)
    return masks


@dataclass(frozen=True)
class SparsePlan:
    """What one variant trains: ``trainable`` names (requires_grad=True) and ``masks``."""

    variant: str
    trainable: tuple[str, ...]
    masks: dict[str, torch.Tensor]
    trained_entries: int  # entries that can change
    total_entries: int

    @property
    def trained_fraction(self) -> float:
        return self.trained_entries / self.total_entries


def plan_variant(model: nn.Module, variant: str, fraction: float = 0.01) -> SparsePlan:
    """Set ``requires_grad`` on ``model`` for ``variant`` and return its plan (masks only for "all")."""
    if variant not in VARIANTS:
        raise InvalidValue(f"unknown variant {variant!r}; choose one of {VARIANTS}")
    groups = parameter_groups(model)
    allowed = {
        "classifier": {"classifier"},
        "classifier+norm": {"classifier", "norm"},
        "all": {"classifier", "norm"},
        "whole": set(GROUPS),
    }[variant]
    masks = magnitude_masks(model, fraction) if variant == "all" else {}
    trainable, trained, total = [], 0, 0
    for name, p in model.named_parameters():
        total += p.numel()
        p.requires_grad_(groups[name] in allowed or name in masks)
        if p.requires_grad:
            trainable.append(name)
            trained += int(masks[name].sum()) if name in masks else p.numel()
    return SparsePlan(variant, tuple(trainable), masks, trained, total)


def noise_to_gradient_ratio(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    noise_multiplier: float,
    max_grad_norm: float,
    masks: dict[str, torch.Tensor] | None = None,
) -> dict[str, dict[str, float]]:
    """The paper's Fig. 3: per parameter and per group, the norm of the DP-SGD noise over the
    norm of the summed clipped gradients of one batch (x, y). No mechanism protects the
    gradients it reads: give it public data (``bench/sparse_finetune.py`` uses public images).

    Gradients are per-example, masked, clipped jointly to ``max_grad_norm`` and summed, as in
    a DP-SGD step; the noise norm is its expectation's usual proxy σC√d, with d the number
    of entries that train. Runs on a copy: ``model`` is not changed. Returns
    {"groups": {group: ratio}, "layers": {name: ratio}}.
    """
    masks = masks or {}
    work = copy.deepcopy(model)
    groups = parameter_groups(work)
    names = [name for name, p in work.named_parameters() if p.requires_grad]
    if not names:
        raise InvalidValue("no trainable parameters")
    wrapped = GradSampleModule(work, loss_reduction="sum")
    work.train()
    loss = nn.functional.cross_entropy(wrapped(x), y, reduction="sum")
    loss.backward()
    params = dict(work.named_parameters())
    per_example = {}
    for name in names:
        g = params[name].grad_sample
        per_example[name] = g * masks[name] if name in masks else g
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_example.values()], dim=1).norm(dim=1)
    factor = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    layers, signal_sq, noise_sq = {}, {}, {}
    for name, g in per_example.items():
        summed = torch.einsum("i,i...->...", factor, g)
        entries = int(masks[name].sum()) if name in masks else g[0].numel()
        noise = noise_multiplier * max_grad_norm * math.sqrt(entries)
        signal = float(summed.norm())
        layers[name] = noise / signal if signal > 0 else math.inf
        group = groups[name]
        signal_sq[group] = signal_sq.get(group, 0.0) + signal**2
        noise_sq[group] = noise_sq.get(group, 0.0) + noise**2
    wrapped.to_standard_module()
    ratio = {
        group: (math.sqrt(noise_sq[group]) / math.sqrt(signal_sq[group]) if signal_sq[group] > 0 else math.inf)
        for group in signal_sq
    }
    return {"groups": ratio, "layers": layers}
