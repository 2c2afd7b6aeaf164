"""Model registry: ``build_model(name, num_classes, ...)`` by name.

Entries are "module:function" strings imported on first use, so asking for a small CNN
never imports the ResNet code and each model file stays independent. Every factory meets
the contract of ``learning.models.contract`` (docs/data-and-models.md, "Your own model"):
it takes ``num_classes`` and those of ``in_channels``, ``input_size``, ``input_shape``,
``standardiser`` it declares, and returns a module mapping ``[batch, *input_shape]`` to
logits ``[batch, num_classes]``; the built-in ones also have ``.features(x)`` and
``.classifier`` (the last Linear).

A name with a colon (``mypkg.models:build``) is a user's own factory, imported by path in
whichever process builds the model; a run ships its package to the workers itself
(``cluster.ray_runtime.start_ray``).
"""
from __future__ import annotations

import importlib

import torch
from torch import nn

from conclave.learning.models.contract import (
    ModelContractError, check_model, contract_arguments, input_hints, user_source,
)

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
    """The factory ``name`` stands for: a registry entry or a ``module:function`` path
    (``ModelContractError``, one line, when it is neither or cannot be imported)."""
    if name in REGISTRY:
        path = REGISTRY[name]
    elif ":" in name:
        path = name
    else:
        raise ModelContractError(f"unknown model {name!r}; choose one of {', '.join(sorted(REGISTRY))} "
                                 "or give a factory as 'module:function'")
    module_name, function_name = path.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - a user's module may fail to import in any way: one line
        text = str(err).strip().splitlines()[0] if str(err).strip() else "(no message)"
        raise ModelContractError(f"model {name!r} cannot be imported here: module {module_name!r}: "
                                 f"{type(err).__name__}: {text} (modules are found from the working "
                                 "directory and the installed packages)") from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        what = "has no" if factory is None else "has a non-callable"
        raise ModelContractError(f"model {name!r}: module {module_name!r} ({module.__file__}) {what} "
                                 f"factory {function_name!r}")
    return factory


def build_model(name: str, num_classes: int, in_channels: int = 1, *, seed: int | None = None,
                input_size: int | None = None, input_shape: tuple[int, ...] | None = None,
                standardiser=None, **kwargs) -> nn.Module:
    """A fresh model ``name``. With ``seed``, its initial weights depend on the seed only
    (the global torch RNG is left as it was). The input hints — ``in_channels``,
    ``input_size`` (an image's side), ``input_shape`` (one example's shape; an image's fixes
    the other two), ``standardiser`` (a table's public column statistics) — reach the
    factories that declare them (``contract.contract_arguments``); ``kwargs`` always do."""
    factory = factory_of(name)
    hints = input_hints(in_channels, input_size, input_shape, standardiser)
    arguments = {**contract_arguments(factory, num_classes, hints), **kwargs}
    if seed is None:
        return factory(**arguments)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory(**arguments)


__all__ = ["REGISTRY", "ModelContractError", "build_model", "check_model", "default_model", "factory_of", "user_source"]
