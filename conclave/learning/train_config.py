"""How one model is trained without privacy (``learning.training.fit``): torch-free, so configs
that name it load without torch (``conclave plan``)."""
from __future__ import annotations

from dataclasses import dataclass
from conclave.errors import InvalidValue

OPTIMIZERS = ("adam", "sgd")


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 5
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    optimizer: str = "adam"   # "adam" or "sgd"
    momentum: float = 0.0     # SGD only

    def __post_init__(self) -> None:
        if self.epochs < 0:
            raise InvalidValue(f"epochs must be ≥ 0, got {self.epochs}")
        if self.batch_size < 1:
            raise InvalidValue(f"batch_size must be ≥ 1, got {self.batch_size}")
        if not self.lr > 0:
            raise InvalidValue(f"lr must be > 0, got {self.lr}")
        if self.weight_decay < 0 or self.momentum < 0:
            raise InvalidValue("weight_decay and momentum must be ≥ 0")
        if self.optimizer not in OPTIMIZERS:
            raise InvalidValue(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
