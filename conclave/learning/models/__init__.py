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

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from conclave.learning.models.contract import check_model, contract_arguments, input_hints, user_source
from conclave.learning.models.registry import REGISTRY, ModelContractError, default_model, factory_of, model_label

def build_model(name: str | Callable[..., Any], num_classes: int, in_channels: int = 1, *, seed: int | None = None,
                input_size: int | None = None, input_shape: tuple[int, ...] | None = None,
                standardiser=None, **kwargs) -> nn.Module:
    """A fresh model ``name`` (a registry name, ``module:function``, or the factory itself). With
    ``seed``, its initial weights depend on the seed only (the global torch RNG is left as it
    was). The input hints — ``in_channels``,
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


__all__ = ["REGISTRY", "ModelContractError", "build_model", "check_model", "default_model", "factory_of", "model_label",
           "user_source"]
