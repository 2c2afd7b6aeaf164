"""Non-private training and inference: fit, predict, predict_logits, embed, evaluate.

Runs on the GPU when one is present, else on the CPU. With the same initial model, data
and ``TrainConfig.seed``, ``fit`` gives the same weights on the same machine: the batch
order comes from a generator seeded with the config, not from global state.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from conclave.errors import InvalidValue
from conclave.learning.data import Dataset
from conclave.learning.train_config import TrainConfig

log = logging.getLogger(__name__)

def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _model_device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    parameters = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=config.lr, momentum=config.momentum,
                               weight_decay=config.weight_decay)
    return torch.optim.Adam(parameters, lr=config.lr, weight_decay=config.weight_decay)


def fit(model: nn.Module, dataset: Dataset, config: TrainConfig, progress: bool = False) -> list[float]:
    """Train ``model`` in place with cross-entropy; returns the mean loss of each epoch."""
    if len(dataset) == 0:
        raise InvalidValue(f"cannot train on {dataset.name}: it is empty")
    device = default_device()
    model.to(device).train()
    optimizer = _make_optimizer(model, config)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.from_numpy(dataset.x), torch.from_numpy(dataset.y)
    order_rng = torch.Generator().manual_seed(config.seed)
    losses: list[float] = []
    epochs = tqdm(range(config.epochs), desc=f"train {dataset.name}", unit="epoch",
                  disable=not progress, leave=False)
    for _ in epochs:
        total = 0.0
        for batch in torch.randperm(len(dataset), generator=order_rng).split(config.batch_size):
            inputs, targets = x[batch].to(device), y[batch].to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        losses.append(total / len(dataset))
        epochs.set_postfix(loss=f"{losses[-1]:.4f}")
    model.eval()
    log.debug("trained on %s: epoch losses %s", dataset.name, losses)
    return losses


def _batched(model: nn.Module, x: np.ndarray, batch_size: int,
             fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> np.ndarray:
    """Apply ``fn(model, batch)`` over ``x`` in eval mode without gradients, as float32 numpy."""
    x = np.asarray(x)
    if x.ndim not in (2, 4) or not np.issubdtype(x.dtype, np.floating):
        raise InvalidValue(f"inputs must be a float array [n, C, H, W] or [n, d], got {x.dtype} {x.shape}")
    model.eval()
    device = _model_device(model)
    outputs = []
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            batch = torch.tensor(np.asarray(x[start:start + batch_size], dtype=np.float32))  # own, aligned memory
            outputs.append(fn(model, batch.to(device)).flatten(1).float().cpu().numpy())
    if not outputs:
        raise InvalidValue("inputs are empty")
    return np.concatenate(outputs)


def predict_logits(model: nn.Module, x: np.ndarray, batch_size: int = 512) -> np.ndarray:
    """float32 [n, k] logits."""
    return _batched(model, x, batch_size, lambda m, b: m(b))


def predict(model: nn.Module, x: np.ndarray, batch_size: int = 512) -> np.ndarray:
    """int64 [n] predicted classes."""
    return predict_logits(model, x, batch_size).argmax(axis=1).astype(np.int64)


def embed(model: nn.Module, x: np.ndarray, batch_size: int = 512) -> np.ndarray:
    """float32 [n, d] activations before the logits (``model.features``, flattened)."""
    return _batched(model, x, batch_size, lambda m, b: m.features(b))


def evaluate(model: nn.Module, dataset: Dataset, batch_size: int = 512) -> float:
    """Accuracy of ``model`` on ``dataset``, in [0, 1]."""
    return float(np.mean(predict(model, dataset.x, batch_size) == dataset.y))
