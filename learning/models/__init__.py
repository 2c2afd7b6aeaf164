"""Model registry: ``build_model(name, num_classes, in_channels)`` by name.

Entries are "module:function" strings imported on first use, so asking for a small CNN
never imports the ResNet code and each model file stays independent. Every factory takes
``(num_classes, in_channels, **kwargs)`` and returns a module with ``.features(x)`` and
``.classifier`` (the last Linear).
"""
from __future__ import annotations

import importlib
import inspect

import torch
from torch import nn

REGISTRY: dict[str, str] = {
    "tutorial_cnn": "learning.models.cnn:tutorial_cnn",   # 28×28, TF Privacy tutorial
    "tutorial_cnn_tanh": "learning.models.cnn:tutorial_cnn_tanh",  # the same with tanh, for DP-SGD
    "scatternet_cnn": "learning.models.scatternet:scatternet_cnn",  # on ScatterNet features
    "digits_cnn": "learning.models.cnn:digits_cnn",       # 8×8 sklearn digits
    "gn_resnet18": "learning.models.resnet:gn_resnet18",  # GroupNorm ResNet-18, kwarg `width`
    "gn_cnn": "learning.models.resnet:gn_cnn",            # small GroupNorm CNN for 32×32
}


def build_model(name: str, num_classes: int, in_channels: int = 1, *, seed: int | None = None,
                input_size: int | None = None, **kwargs) -> nn.Module:
    """A fresh model ``name``. With ``seed``, its initial weights depend on the seed only
    (the global torch RNG is left as it was). ``input_size`` (the inputs' side) reaches the
    factories whose layers depend on it; size-agnostic models do not need it."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(sorted(REGISTRY))}")
    module_name, function_name = REGISTRY[name].split(":")
    factory = getattr(importlib.import_module(module_name), function_name)
    if input_size is not None and "input_size" in inspect.signature(factory).parameters:
        kwargs["input_size"] = input_size
    if seed is None:
        return factory(num_classes=num_classes, in_channels=in_channels, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory(num_classes=num_classes, in_channels=in_channels, **kwargs)


__all__ = ["REGISTRY", "build_model"]
