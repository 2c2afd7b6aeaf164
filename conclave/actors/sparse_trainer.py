"""The private side of sparse DP fine-tuning: what the shard actors fine-tune, and on what.

A ``SparseVariant`` is a training recipe for ``actors.dp_trainer.ShardGroup``: the *public*
pre-trained weights with a fresh classifier, and the variant's plan (which parameters train,
and the magnitude mask, computed from those public weights only). The private transfer set is
read by the shard actors themselves — a benchmark's (``TransferSource``) or the owners' own
files — so it never passes through the driver, which charges the run's ledger with each
variant's DP-SGD schedule before asking the actors to train. Only the DP weights come back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from conclave.errors import InvalidValue
from conclave.learning.data import Dataset
from conclave.learning.models import build_model
from conclave.learning.sparse import SparsePlan, plan_variant, replace_classifier, transfer_split


@dataclass(frozen=True)
class TransferSource:
    """A benchmark's private set: ``dataset``'s training split restricted to ``classes``
    (relabelled 0..k-1; all classes when empty), optionally a seeded subsample of ``size``
    examples; held whole by one shard actor (shard 0)."""

    dataset: str
    root: str | None = None
    classes: tuple[int, ...] = ()
    size: int | None = None
    seed: int = 0

    @property
    def owner(self) -> str:
        return f"{self.dataset} (private split)"

    def load(self, shard_ids: Sequence[int] = (0,)) -> Dataset:
        if list(shard_ids) != [0]:
            raise InvalidValue(f"a transfer set is one shard (0), got {list(shard_ids)}")
        train, _ = transfer_split(self.dataset, self.root, self.classes, self.size, self.seed)
        return train


@dataclass(frozen=True)
class PublicModel:
    """A public pre-trained network: model name, constructor arguments, weights, and the
    public inputs' shape (the model contract's ``input_shape`` hint)."""

    name: str
    num_classes: int
    in_channels: int
    kwargs: dict = field(default_factory=dict)
    state: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    input_shape: tuple[int, ...] | None = None

    def build(self) -> torch.nn.Module:
        model = build_model(self.name, self.num_classes, self.in_channels, input_shape=self.input_shape,
                            **self.kwargs)
        model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in self.state.items()})
        return model


@dataclass(frozen=True)
class SparseVariant:
    """Fine-tune ``public`` for ``num_classes`` private classes under ``variant`` (see
    ``learning.sparse``): what a shard actor trains, with DP-SGD, on its private data."""

    public: PublicModel
    variant: str
    fraction: float
    num_classes: int
    classifier_seed: int = 0

    def planned(self) -> tuple[torch.nn.Module, SparsePlan]:
        model = replace_classifier(self.public.build(), self.num_classes, seed=self.classifier_seed)
        return model, plan_variant(model, self.variant, self.fraction)

    def prepare(self) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        model, plan = self.planned()
        return model, plan.masks

    def released(self, state: dict[str, np.ndarray]) -> torch.nn.Module:
        """The fine-tuned network with the DP weights ``state``."""
        model = replace_classifier(self.public.build(), self.num_classes)
        model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()})
        return model
