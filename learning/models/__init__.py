"""Model registry: ``build_model(name, num_classes, in_channels)`` by name.

Entries are "module:function" strings imported on first use, so asking for a small CNN
never imports the ResNet code and each model file stays independent. Every factory takes
``(num_classes, in_channels, **kwargs)`` and returns a module with ``.features(x)`` and
``.classifier`` (the last Linear).

A name with a colon (``mypkg.models:build``) is a user's own factory, imported by path in
whichever process builds the model (ship its package to the workers with Ray's
``runtime_env``); it takes the same arguments.
"""
from __future__ import annotations

import importlib
import inspect

import torch
from torch import nn

REGISTRY: dict[str, str] = {
    "tutorial_cnn": "conclave.learning.models.cnn:tutorial_cnn",   # 28×28, TF Privacy tutorial
    "tutorial_cnn_tanh": "conclave.learning.models.cnn:tutorial_cnn_tanh",  # the same with tanh, for DP-SGD
    "scatternet_cnn": "conclave.learning.models.scatternet:scatternet_cnn",  # on ScatterNet features
    "digits_cnn": "conclave.learning.models.cnn:digits_cnn",       # 8×8 sklearn digits
    "gn_resnet18": "conclave.learning.models.resnet:gn_resnet18",  # GroupNorm ResNet-18, kwarg `width`
    "gn_cnn": "conclave.learning.models.resnet:gn_cnn",            # small GroupNorm CNN for 32×32
    "mlp": "conclave.learning.models.table:mlp",                   # table rows [n, d]
    "logistic_regression": "conclave.learning.models.table:logistic_regression",  # table rows [n, d]
}


def default_model(input_shape: tuple[int, ...], kind: str) -> str:
    """The model a config gets when it names none: by what the inputs are."""
    if kind == "table":
        return "mlp"
    side = input_shape[-1]
    return "digits_cnn" if side <= 8 else "tutorial_cnn" if side <= 28 else "gn_cnn"


def factory_of(name: str):
    """The factory ``name`` stands for: a registry entry or a ``module:function`` path."""
    if name in REGISTRY:
        path = REGISTRY[name]
    elif ":" in name:
        path = name
    else:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(sorted(REGISTRY))} "
                         "or give a factory as 'module:function'")
    module_name, function_name = path.split(":", 1)
    try:
        return getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"model {name!r} cannot be imported here: {err}") from None


def build_model(name: str, num_classes: int, in_channels: int = 1, *, seed: int | None = None,
                input_size: int | None = None, input_shape: tuple[int, ...] | None = None,
                standardiser=None, **kwargs) -> nn.Module:
    """A fresh model ``name``. With ``seed``, its initial weights depend on the seed only
    (the global torch RNG is left as it was). The input hints — ``input_size`` (an image's
    side), ``input_shape`` (one example's shape), ``standardiser`` (a table's public column
    statistics) — reach the factories that declare them; the others do not need them."""
    factory = factory_of(name)
    if input_shape is not None and len(input_shape) == 3:
        in_channels, input_size = int(input_shape[0]), int(input_shape[-1])
    hints = {"input_size": input_size, "input_shape": input_shape, "standardiser": standardiser}
    accepted = inspect.signature(factory).parameters
    kwargs.update({k: v for k, v in hints.items() if v is not None and k in accepted})
    if seed is None:
        return factory(num_classes=num_classes, in_channels=in_channels, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory(num_classes=num_classes, in_channels=in_channels, **kwargs)


__all__ = ["REGISTRY", "build_model", "default_model", "factory_of"]
