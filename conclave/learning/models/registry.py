"""The model registry: names → "module:function" factories, imported on first use, and a
user's own ``module:function`` resolved the same way — or the user's factory itself, passed
as a callable through the library (as Opacus takes the user's model). Adding a model is its
file and one line in ``REGISTRY``."""
from __future__ import annotations

from typing import Any, Callable

from conclave.errors import ConclaveError, first_line
from conclave.registry import MissingAttribute, Registry, import_path, imported


class ModelContractError(ConclaveError, ValueError):
    """A model that does not meet the contract (``learning.models.contract``), or cannot be found;
    its message is one line naming the model."""


REGISTRY: Registry[Callable[..., Any]] = Registry("model", {
    "tutorial_cnn": "conclave.learning.models.cnn:tutorial_cnn",   # 28×28, TF Privacy tutorial
    "tutorial_cnn_tanh": "conclave.learning.models.cnn:tutorial_cnn_tanh",  # the same with tanh, for DP-SGD
    "scatternet_cnn": "conclave.learning.models.scatternet:scatternet_cnn",  # on ScatterNet features
    "scatternet_cnn_wide": "conclave.learning.models.scatternet:scatternet_cnn_wide",  # the same, width 128
    "scatternet_cnn_wide_relu": "conclave.learning.models.scatternet:scatternet_cnn_wide_relu",  # and ReLU
    "digits_cnn": "conclave.learning.models.cnn:digits_cnn",       # 8×8 sklearn digits
    "digits_cnn_wide": "conclave.learning.models.cnn:digits_cnn_wide",  # the same, width 32
    "gn_resnet18": "conclave.learning.models.resnet:gn_resnet18",  # GroupNorm ResNet-18, kwarg `width`
    "gn_cnn": "conclave.learning.models.resnet:gn_cnn",            # small GroupNorm CNN for 32×32
    "mlp": "conclave.learning.models.table:mlp",                   # table rows [n, d]
    "logistic_regression": "conclave.learning.models.table:logistic_regression",  # table rows [n, d]
    "quadratic": "conclave.learning.models.table:quadratic",       # table rows: columns and their products
})


def default_model(input_shape: tuple[int, ...], kind: str) -> str:
    """The model a config gets when it names none: by what the inputs are."""
    if kind == "table":
        return "mlp"
    side = input_shape[-1]
    return "digits_cnn" if side <= 8 else "tutorial_cnn" if side <= 28 else "gn_cnn"


def model_label(model: str | Callable[..., Any]) -> str:
    """How messages and results name a model: its registry name or path, or a factory's
    ``module:qualname`` (a name a later run can import it by, unless it lives in ``__main__``)."""
    if not callable(model):
        return model
    return import_path(model)


def factory_of(name: str | Callable[..., Any]) -> Callable[..., Any]:
    """The factory ``name`` stands for: the factory itself when it is one, a registry entry or a
    ``module:function`` path (``ModelContractError``, one line, when it is neither or cannot be
    imported)."""
    if callable(name):
        return name
    if not isinstance(name, str):
        raise ModelContractError(f"model {name!r}: give a name, 'module:function' or the factory itself")
    if name in REGISTRY:
        path = REGISTRY.path(name)
    elif ":" in name:
        path = name
    else:
        raise ModelContractError(f"unknown model {name!r}; known: {', '.join(REGISTRY.names)}; "
                                 "or give a factory as 'module:function'")
    try:
        factory = imported(path)
    except MissingAttribute as err:
        raise ModelContractError(f"model {name!r}: module {err.obj.__name__!r} ({err.obj.__file__}) has no "
                                 f"factory {err.name!r}") from None
    except Exception as err:  # noqa: BLE001 - a user's module may fail to import in any way: one line
        raise ModelContractError(f"model {name!r} cannot be imported here: module {path.partition(':')[0]!r}: "
                                 f"{type(err).__name__}: {first_line(err)} (modules are found from the working "
                                 "directory and the installed packages)") from None
    if not callable(factory):
        raise ModelContractError(f"model {name!r}: {path!r} is not a callable factory")
    return factory
