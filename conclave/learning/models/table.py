"""Models for table rows ``[n, d]``: logistic regression, logistic regression on the columns
and their pairwise products (``quadratic``) and a small MLP.

Each starts with a fixed ``Standardise`` layer whose statistics come from public data
(``learning.data.schema.Standardiser``), so clients send raw column values and nothing about
an owner's records is baked into the model's input scaling. The layer has buffers, no
parameters: DP-SGD and the optimiser never touch it.

``quadratic`` is the table model DP-SGD across owners reaches furthest with on our proxies
(``bench/proposal_proxy.py``): its boundaries are quadrics, as a Gaussian class's are, yet it is
convex, so full-batch DP-SGD converges in tens of noised steps where an MLP needs hundreds; its
standardised columns are clamped to ±``QUADRATIC_CLAMP`` so no record's features are unbounded.
"""
from __future__ import annotations


import torch
from torch import nn

from conclave.errors import InvalidValue
from conclave.learning.data.schema import Standardiser


class Standardise(nn.Module):
    def __init__(self, width: int, standardiser: Standardiser | None) -> None:
        super().__init__()
        mean = torch.zeros(width) if standardiser is None else torch.tensor(standardiser.mean)
        scale = torch.ones(width) if standardiser is None else torch.tensor(standardiser.scale)
        if mean.shape != (width,):
            raise InvalidValue(f"standardiser has {mean.shape[0]} columns, the inputs {width}")
        self.register_buffer("mean", mean.float())
        self.register_buffer("scale", scale.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.scale


class TableModel(nn.Module):
    """``features`` (standardise, hidden layers) then ``classifier`` (the last Linear)."""

    def __init__(self, features: nn.Module, classifier: nn.Linear) -> None:
        super().__init__()
        self.features = features
        self.classifier = classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _width(input_shape: tuple[int, ...]) -> int:
    if len(input_shape) != 1:
        raise InvalidValue(f"table models take rows [n, d]; got inputs of shape {list(input_shape)}")
    return int(input_shape[0])


def mlp(num_classes: int, in_channels: int = 1, *, input_shape: tuple[int, ...],
        standardiser: Standardiser | None = None, hidden: int = 64) -> TableModel:
    """Two hidden layers of ``hidden`` tanh units (tanh: bounded activations suit DP-SGD)."""
    width = _width(input_shape)
    features = nn.Sequential(Standardise(width, standardiser), nn.Linear(width, hidden), nn.Tanh(),
                             nn.Linear(hidden, hidden), nn.Tanh())
    return TableModel(features, nn.Linear(hidden, num_classes))


QUADRATIC_CLAMP = 4.0  # standard deviations of the public pool: a column's value past it counts as this far


class PairwiseProducts(nn.Module):
    """``[z, z_i·z_j / √2 for i ≤ j]`` of the standardised row ``z``, each column clamped to ±``clamp``
    (the √2 keeps a product's scale that of a square's half, so both kinds of term start alike)."""

    def __init__(self, width: int, clamp: float = QUADRATIC_CLAMP) -> None:
        super().__init__()
        first, second = torch.triu_indices(width, width)
        self.register_buffer("first", first)
        self.register_buffer("second", second)
        self.clamp = clamp

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = z.clamp(-self.clamp, self.clamp)
        return torch.cat([z, z[:, self.first] * z[:, self.second] / 2 ** 0.5], dim=1)


def quadratic_features(width: int) -> int:
    """How many features ``quadratic`` computes from ``width`` columns (its classifier's inputs)."""
    return width + width * (width + 1) // 2


def quadratic(num_classes: int, in_channels: int = 1, *, input_shape: tuple[int, ...],
              standardiser: Standardiser | None = None) -> TableModel:
    """Multinomial logistic regression on the standardised columns (clamped) and their pairwise products."""
    width = _width(input_shape)
    features = nn.Sequential(Standardise(width, standardiser), PairwiseProducts(width))
    model = TableModel(features, nn.Linear(quadratic_features(width), num_classes))
    nn.init.zeros_(model.classifier.weight)  # convex in its weights: no symmetry to break
    nn.init.zeros_(model.classifier.bias)
    return model


def logistic_regression(num_classes: int, in_channels: int = 1, *, input_shape: tuple[int, ...],
                        standardiser: Standardiser | None = None) -> TableModel:
    """Multinomial logistic regression on the standardised columns."""
    width = _width(input_shape)
    model = TableModel(Standardise(width, standardiser), nn.Linear(width, num_classes))
    nn.init.zeros_(model.classifier.weight)  # the convex problem needs no symmetry breaking
    nn.init.zeros_(model.classifier.bias)
    return model


