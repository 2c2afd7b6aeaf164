"""The contract every model factory meets, the built-in ones and a user's own
(docs/data-and-models.md, "Your own model").

A factory is named by the registry or by ``module:function``. It is called with keywords:
``num_classes`` always, and of ``HINTS`` only those it declares by name (a table model need
not take ``in_channels``; a ``**kwargs`` catch-all gets none of them). It returns a
``torch.nn.Module`` that maps a float32 batch ``[batch, *input_shape]`` to logits
``[batch, num_classes]``. Pipelines that need more ask for ``PARTS`` of it.

``check_model`` checks all of this on the driver before Ray starts, from public facts only
(the inputs' shape, the public pool's standardiser): the factory is imported and called, and
a batch of two zero inputs goes through the model. Every failure is one ``ModelContractError``
line naming the model and the problem.
"""
from __future__ import annotations

import importlib.util
import inspect
import site
import sysconfig
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conclave.errors import first_line
from conclave.learning.models.registry import ModelContractError, factory_of, model_label

HINTS = ("in_channels", "input_size", "input_shape", "standardiser")
# What a pipeline may need besides the logits, and what it is.
PARTS = {
    "features": ".features(x) (the activations before the logits)",
    "classifier": ".classifier (the last nn.Linear)",
}
CHECK_BATCH = 2  # zero inputs sent through the model: two, so a batch dimension mix-up shows


def input_hints(in_channels: int | None, input_size: int | None, input_shape: tuple[int, ...] | None,
                standardiser: Any) -> dict[str, Any]:
    """The hints the contract offers for these inputs; an image's shape [C, H, W] fixes its
    channels and side."""
    if input_shape is not None:
        input_shape = tuple(int(d) for d in input_shape)
        if len(input_shape) == 3:
            in_channels, input_size = input_shape[0], input_shape[-1]
    return {"in_channels": in_channels, "input_size": input_size, "input_shape": input_shape,
            "standardiser": standardiser}


def declared_parameters(factory: Callable) -> tuple[str, ...]:
    """The names ``factory`` can take as keywords (none when its signature cannot be read)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return ()
    keywords = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in parameters if p.kind in keywords)


def contract_arguments(factory: Callable, num_classes: int, hints: Mapping[str, Any]) -> dict[str, Any]:
    """What the contract passes ``factory``: ``num_classes``, and the known hints it declares."""
    declared = declared_parameters(factory)
    return {"num_classes": num_classes,
            **{k: v for k, v in hints.items() if v is not None and k in declared}}


def check_model(name: str | Callable[..., Any], num_classes: int, input_shape: tuple[int, ...], *,
                parts: Mapping[str, str] | None = None, dp_sgd: bool = False, standardiser: Any = None,
                **kwargs: Any) -> None:
    """Check model ``name`` against the contract for inputs of ``input_shape`` and
    ``num_classes`` classes: it imports, takes the contract's arguments (and ``kwargs``, a
    config's extra ones), builds an ``nn.Module`` whose logits on a zero batch have the right
    shape, has the ``parts`` asked for (part → why the pipeline needs it), and, with
    ``dp_sgd``, is a model Opacus can train. ``ModelContractError`` (one line) otherwise.
    ``name`` may be the factory itself."""

    factory = factory_of(name)
    name = model_label(name)  # what the messages call it
    hints = input_hints(None, None, input_shape, standardiser)
    arguments = {**contract_arguments(factory, num_classes, hints), **kwargs}
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        signature = None  # a callable without a readable signature: calling it is the check
    try:
        if signature is not None:
            signature.bind(**arguments)
    except TypeError as err:
        declared = ", ".join(declared_parameters(factory)) or "nothing by name"
        raise ModelContractError(
            f"model {name!r} cannot be called as the contract calls it ({err}): the contract passes "
            f"num_classes and any of {', '.join(HINTS)} the factory declares (here: {_given(arguments)}); "
            f"the factory declares {declared}") from None
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = factory(**arguments)
    except Exception as err:  # noqa: BLE001 - a user's factory may raise anything: one line
        raise ModelContractError(f"model {name!r}: the factory failed with {_given(arguments)}: "
                                 f"{_one_line(err)}") from None
    if not isinstance(model, nn.Module):
        raise ModelContractError(f"model {name!r}: the factory returned {type(model).__name__}, "
                                 "not a torch.nn.Module")
    batch = torch.zeros((CHECK_BATCH, *hints["input_shape"]), dtype=torch.float32)
    shown = list(batch.shape)
    model.eval()
    with torch.no_grad():
        try:
            logits = model(batch)
        except Exception as err:  # noqa: BLE001
            raise ModelContractError(f"model {name!r}: a forward pass on a float32 batch of shape {shown} "
                                     f"failed: {_one_line(err)}") from None
        if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (CHECK_BATCH, num_classes):
            got = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ModelContractError(f"model {name!r} maps a batch of shape {shown} to {got}; the contract "
                                     f"wants logits [batch, num_classes] = {[CHECK_BATCH, num_classes]}")
        for part, why in (parts or {}).items():
            _check_part(name, model, part, why, batch)
    if dp_sgd:
        from opacus.validators import ModuleValidator

        problems = ModuleValidator.validate(model.train(), strict=False)  # it validates training mode
        if problems:
            raise ModelContractError(f"model {name!r} cannot be trained with DP-SGD (Opacus): "
                                     f"{_one_line(problems[0])}")


def _check_part(name: str, model: nn.Module, part: str, why: str, batch: torch.Tensor) -> None:
    missing = f"model {name!r} has no {PARTS[part]}, which {why}"
    if part == "classifier":
        if not isinstance(getattr(model, "classifier", None), nn.Linear):
            raise ModelContractError(missing)
        return
    features = getattr(model, "features", None)
    if not callable(features):
        raise ModelContractError(missing)
    try:
        activations = features(batch)
    except Exception as err:  # noqa: BLE001
        raise ModelContractError(f"model {name!r}: .features(x) on a batch of shape {list(batch.shape)} "
                                 f"failed: {_one_line(err)}") from None
    if not isinstance(activations, torch.Tensor) or activations.ndim < 2 or len(activations) != len(batch):
        got = list(activations.shape) if isinstance(activations, torch.Tensor) else type(activations).__name__
        raise ModelContractError(f"model {name!r}: .features(x) maps a batch of shape {list(batch.shape)} to "
                                 f"{got}; it must give [batch, ...] activations")


def _given(arguments: Mapping[str, Any]) -> str:
    shown = {k: (v if k != "standardiser" else "<public column statistics>") for k, v in arguments.items()}
    return ", ".join(f"{k}={v}" for k, v in shown.items())


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {first_line(err)}"


# --- shipping a user's factory to the workers -------------------------------------------------


def _installed_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    roots += [*site.getsitepackages(), site.getusersitepackages()]
    return [Path(root).resolve() for root in roots]


def user_source(name: str | Callable[..., Any]) -> Path | None:
    """Where a user's factory ``module:function`` (or the factory itself) lives when it is not an
    installed package: the folder of its top-level package, or its module file — what Ray's
    ``py_modules`` ships to workers so they import it as the driver does. None for built-in
    models, installed packages, modules that cannot be found (``check_model`` reports those) and
    a factory of the script being run (``__main__``: Ray sends such a function by value)."""
    if callable(name):
        if getattr(name, "__module__", "__main__") == "__main__":
            return None
        name = model_label(name)
    if ":" not in name:
        return None  # a registry name: part of this package
    top = name.split(":", 1)[0].split(".", 1)[0]
    if top == "conclave":
        return None
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations)))
    elif spec.origin and spec.origin.endswith(".py"):
        path = Path(spec.origin)
    else:
        return None  # a built-in or extension module: installed, not shipped
    path = path.resolve()
    return None if any(path.is_relative_to(root) for root in _installed_roots()) else path
