"""Small networks on ScatterNet features (``learning.data.features``), after Tramèr & Boneh
("Differentially private learning needs better features (or much more data)", ICLR 2021).

The input is the scattering of an image: ``[n, C·81, H/4, W/4]`` (81 coefficients per image
channel for J = 2, L = 8). Scattering coefficients differ in scale by orders of magnitude
between the low-pass map and the wavelet paths, so both models start with a GroupNorm
without learned affine weights: it normalises each example by itself, which costs no
privacy (a data normalisation would need private statistics) and is Opacus-compatible.
"""
from __future__ import annotations

from torch import nn

from conclave.errors import InvalidValue
from conclave.learning.models.cnn import FeatureClassifier, activation_named
from conclave.learning.models.pooling import MaxPool2d

SCATTERING_COEFFICIENTS = 81  # per image channel, J = 2, L = 8


def _norm(in_channels: int) -> nn.GroupNorm:
    # 27 groups of 3 channels for 81 coefficients, as in Tramèr & Boneh.
    groups = in_channels // 3 if in_channels % 3 == 0 else 1
    return nn.GroupNorm(groups, in_channels, affine=False)


def scatternet_cnn(num_classes: int = 10, in_channels: int = SCATTERING_COEFFICIENTS,
                   input_size: int = 7, width: int = 32, activation: str = "tanh") -> FeatureClassifier:
    """GroupNorm → conv 3×3 (``width``) → act → max-pool 2 → conv 3×3 (``width``) → act →
    fc ``width`` → act → fc k. Tanh by default: bounded activations lose less to clipping under
    DP-SGD (Papernot et al. 2021). For 81×7×7 inputs (28×28 images) and 10 classes: 42,186
    parameters; its ``width``-dimensional embedding is what NearPrivate's DP-PCA sees."""
    act = activation_named(activation)
    pooled = input_size // 2
    if pooled < 1:
        raise InvalidValue(f"scatternet_cnn needs feature maps of at least 2×2, got {input_size}×{input_size}")
    body = nn.Sequential(
        _norm(in_channels),
        nn.Conv2d(in_channels, width, 3, padding=1), act(), MaxPool2d(2),
        nn.Conv2d(width, width, 3, padding=1), act(),
        nn.Flatten(), nn.Linear(width * pooled * pooled, width), act(),
    )
    return FeatureClassifier(body, nn.Linear(width, num_classes))


def scatternet_cnn_wide(num_classes: int = 10, in_channels: int = SCATTERING_COEFFICIENTS,
                        input_size: int = 7) -> FeatureClassifier:
    """``scatternet_cnn`` at width 128: the student's model where labels are plenty (its ceiling on
    all 9,000 MNIST pool labels is in docs/results.md); too many parameters for DP-SGD's noise."""
    return scatternet_cnn(num_classes, in_channels, input_size, width=128)


def scatternet_cnn_wide_relu(num_classes: int = 10, in_channels: int = SCATTERING_COEFFICIENTS,
                             input_size: int = 7) -> FeatureClassifier:
    """``scatternet_cnn_wide`` with ReLU: a student trained on released labels (no clipping, so
    tanh buys nothing); on the public proxy it beat the tanh one (``bench/student_proxy.py``)."""
    return scatternet_cnn(num_classes, in_channels, input_size, width=128, activation="relu")
