"""Small convolutional networks: the TF Privacy tutorial CNN (28×28) and a CNN for 8×8 digits.

Both split into ``features`` (everything up to the last hidden activation) and
``classifier`` (the last Linear), so the same model can be trained, asked for logits, or
asked for embeddings. No BatchNorm and no in-place activations: Opacus computes
per-example gradients through every layer here.
"""
from __future__ import annotations

import torch
from torch import nn

from conclave.errors import InvalidValue
from conclave.learning.models.pooling import MaxPool2d


class FeatureClassifier(nn.Module):
    """``forward(x) = classifier(features(x))``, with the two parts reachable by name."""

    def __init__(self, body: nn.Sequential, classifier: nn.Linear) -> None:
        super().__init__()
        self.body = body
        self.classifier = classifier

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    return (size + 2 * padding - kernel) // stride + 1


ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh}


def activation_named(name: str) -> type[nn.Module]:
    """The activation a factory's ``activation`` argument names (one line when it names none)."""
    if name not in ACTIVATIONS:
        raise InvalidValue(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


def tutorial_cnn(num_classes: int = 10, in_channels: int = 1, input_size: int = 28,
                 activation: str = "relu") -> FeatureClassifier:
    """The CNN of the TensorFlow Privacy MNIST DP-SGD tutorial (used by Abadi-style baselines
    and Zhao et al. 2019): conv 16 8×8 stride 2 ('same' padding, 3 here) → act → max-pool 2
    stride 1 → conv 32 4×4 stride 2 → act → max-pool 2 stride 1 → fc 32 → act → fc k.
    For 28×28×1 and 10 classes: 26,010 parameters."""
    act = activation_named(activation)
    size = _conv_out(_conv_out(input_size, 8, 2, 3), 2)          # 28 → 14 → 13
    size = _conv_out(_conv_out(size, 4, 2), 2)                   # 13 → 5 → 4
    if size < 1:
        raise InvalidValue(f"tutorial_cnn needs inputs of at least 16×16, got {input_size}×{input_size}")
    body = nn.Sequential(
        nn.Conv2d(in_channels, 16, 8, stride=2, padding=3), act(), MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, stride=2), act(), MaxPool2d(2, 1),
        nn.Flatten(), nn.Linear(32 * size * size, 32), act(),
    )
    return FeatureClassifier(body, nn.Linear(32, num_classes))


def tutorial_cnn_tanh(num_classes: int = 10, in_channels: int = 1, input_size: int = 28) -> FeatureClassifier:
    """``tutorial_cnn`` with tanh activations, for DP-SGD: bounded activations keep gradient
    norms small, so clipping discards less signal (Papernot et al. 2021, "Tempered sigmoid
    activations for deep learning with differential privacy", AAAI; tanh is their tempered
    sigmoid with s = 2, T = 2, o = 1). On 40,000 MNIST images at ε = 3 it gains about two
    points over ReLU (docs/active-learning.md)."""
    return tutorial_cnn(num_classes, in_channels, input_size, activation="tanh")


def digits_cnn(num_classes: int = 10, in_channels: int = 1, input_size: int = 8, width: int = 16) -> FeatureClassifier:
    """A small CNN for scikit-learn's 8×8 digits: two 3×3 convs (``width``, 2·``width``) →
    max-pool 2 → fc 4·``width`` → fc k. For 8×8×1 and 10 classes: 38,282 parameters."""
    if input_size % 2 or input_size < 2:
        raise InvalidValue(f"digits_cnn needs an even input size, got {input_size}")
    size = input_size // 2
    body = nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * size * size, 4 * width), nn.ReLU(),
    )
    return FeatureClassifier(body, nn.Linear(4 * width, num_classes))


def digits_cnn_wide(num_classes: int = 10, in_channels: int = 1, input_size: int = 8) -> FeatureClassifier:
    """``digits_cnn`` at width 32 (151,306 parameters): a student with a whole pool labelled, some
    labels wrong (public-cluster votes), where FixMatch's long training needs the capacity
    (chosen on a public proxy: configs/demo.yaml)."""
    return digits_cnn(num_classes, in_channels, input_size, width=32)
