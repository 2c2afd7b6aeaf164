"""Models for table rows ``[n, d]``: logistic regression, logistic regression on the columns
and their pairwise products (``quadratic``) and a small MLP.

Each starts with a fixed ``Standardise`` layer whose statistics come from public data
(``learning.data.schema.Standardiser``), so clients send raw column values and nothing about
an owner's records is baked into the model's input scaling. The layer has buffers, no
parameters: DP-SGD and the optimiser never touch it. Its ``keep`` mask (all columns unless the
standardiser drops some) sets the dropped columns to 0.

``quadratic`` is the table model DP-SGD across owners reaches furthest with on our proxies
(``bench/proposal_proxy.py``): its boundaries are quadrics, as a Gaussian class's are, yet it is
convex, so full-batch DP-SGD converges in tens of noised steps where an MLP needs hundreds; its
standardised columns are clamped to ±``QUADRATIC_CLAMP`` so no record's features are unbounded.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from conclave.errors import InvalidValue
from conclave.learning.data.schema import Standardiser


class Standardise(nn.Module):
    """``(x - mean) / scale``, then the columns the standardiser does not ``keep`` set to exactly 0.

    A dropped column (screening, ``cluster.active_gateways``) then contributes nothing to any feature
    built from it — its pairwise products are 0 too — so its weights get exactly zero gradient from
    every record; the DP noise a run adds to those weights changes no prediction (their inputs are
    0), and only the kept columns' weights carry noise that matters."""

    def __init__(self, width: int, standardiser: Standardiser | None) -> None:
        super().__init__()
        mean = torch.zeros(width) if standardiser is None else torch.tensor(standardiser.mean)
        scale = torch.ones(width) if standardiser is None else torch.tensor(standardiser.scale)
        if mean.shape != (width,):
            raise InvalidValue(f"standardiser has {mean.shape[0]} columns, the inputs {width}")
        keep = None if standardiser is None else standardiser.keep
        self.register_buffer("mean", mean.float())
        self.register_buffer("scale", scale.float())
        # a buffer, so a checkpoint's state carries the columns its model reads
        self.register_buffer("keep", torch.ones(width, dtype=torch.bool) if keep is None else torch.tensor(keep))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # where, not a product: a dropped column is 0 even where its value is not finite
        return torch.where(self.keep, (x - self.mean) / self.scale, 0.0)


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


SCREENING_MODEL = "logistic_regression"  # DP column screening's model: one weight column per table column


def kept_columns(weight: np.ndarray, share: float) -> np.ndarray:
    """Screening's choice (bool [d]): the columns whose weight column in a logistic regression's
    classifier ``weight`` ([classes, d], on standardised inputs) has an L2 norm over the classes at
    least ``share`` of the largest. Applied to a DP model's weights it is post-processing: free."""
    if weight.ndim != 2 or not 0 < share <= 1:
        raise InvalidValue(f"kept_columns takes a [classes, d] weight and a share in (0, 1], got "
                           f"{list(weight.shape)} and {share}")
    norms = np.linalg.norm(np.asarray(weight, dtype=np.float64), axis=0)
    return norms >= share * norms.max()  # the largest always: at least one column
