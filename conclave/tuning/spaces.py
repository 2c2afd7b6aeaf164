"""Search spaces: YAML domains → Ray Tune domains, and a trial's values → its run config.

Each key of a sweep's ``space`` is a dotted path into the base run config
(``teachers.count``, ``finetune.fraction``) mapped to one domain:

    {choice: [a, b, ...]}        one of the values, sampled
    {grid: [a, b, ...]}          every value (times num_samples)
    {uniform: [low, high]}       a float
    {loguniform: [low, high]}    a float, uniform in log scale
    {randint: [low, high]}       an integer in [low, high)
    {simplex: {keys: [k1, k2, ...], total: T, minimum: m}}
                                 values for several keys that sum to T, each ≥ m,
                                 uniform on that simplex (the space key is only a label)

The simplex samples one uniform u_i per key and sets x_i = −log u_i / Σ_j −log u_j: the
normalised exponentials are Dirichlet(1, …, 1), i.e. uniform on the simplex (Devroye 1986,
§V.4). Sampling goes through Tune's own uniform domains, so the search's seed fixes it.
"""
from __future__ import annotations

import copy
import math
from typing import Any

from conclave.cluster.api import ConfigError

DOMAINS = ("choice", "grid", "uniform", "loguniform", "randint", "simplex")
_TINY = 1e-12  # keeps −log u finite


def _spec(key: str, spec: Any) -> tuple[str, Any]:
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in DOMAINS:
        raise ConfigError(f"space.{key}: expected one of {{{', '.join(DOMAINS)}}}: ..., got {spec!r}")
    kind, value = next(iter(spec.items()))
    if kind in ("choice", "grid"):
        if not isinstance(value, list) or not value:
            raise ConfigError(f"space.{key}.{kind}: expected a non-empty list, got {value!r}")
    elif kind in ("uniform", "loguniform", "randint"):
        if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value)
                and value[0] < value[1]):
            raise ConfigError(f"space.{key}.{kind}: expected [low, high] with low < high, got {value!r}")
        if kind == "loguniform" and value[0] <= 0:
            raise ConfigError(f"space.{key}.loguniform: bounds must be > 0, got {value!r}")
    else:  # simplex
        if not isinstance(value, dict) or set(value) - {"keys", "total", "minimum"} or "keys" not in value \
                or "total" not in value:
            raise ConfigError(f"space.{key}.simplex: expected {{keys: [...], total: T, minimum: m}}, got {value!r}")
        keys, total, minimum = value["keys"], value["total"], value.get("minimum", 0.0)
        if not isinstance(keys, list) or len(keys) < 2 or not all(isinstance(k, str) for k in keys):
            raise ConfigError(f"space.{key}.simplex.keys: expected at least two dotted keys, got {keys!r}")
        if not total > 0 or minimum < 0 or minimum * len(keys) >= total:
            raise ConfigError(f"space.{key}.simplex: need total > 0 and 0 <= minimum < total / {len(keys)}")
    return kind, value


def search_space(space: dict[str, Any]) -> dict[str, Any]:
    """Tune's ``param_space`` for a sweep's ``space``."""
    from ray import tune

    params: dict[str, Any] = {}
    for key, spec in space.items():
        kind, value = _spec(key, spec)
        if kind == "choice":
            params[key] = tune.choice(value)
        elif kind == "grid":
            params[key] = tune.grid_search(value)
        elif kind == "uniform":
            params[key] = tune.uniform(*value)
        elif kind == "loguniform":
            params[key] = tune.loguniform(*value)
        elif kind == "randint":
            params[key] = tune.randint(int(value[0]), int(value[1]))
        else:
            for i in range(len(value["keys"])):
                params[f"{key}[{i}]"] = tune.uniform(_TINY, 1.0)
    return params


def overrides(space: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Dotted key → value for one trial (simplex labels expanded to their keys)."""
    values: dict[str, Any] = {}
    for key, spec in space.items():
        kind, value = _spec(key, spec)
        if kind != "simplex":
            values[key] = params[key]
            continue
        weights = [-math.log(max(params[f"{key}[{i}]"], _TINY)) for i in range(len(value["keys"]))]
        minimum = float(value.get("minimum", 0.0))
        spare = float(value["total"]) - minimum * len(weights)
        for target, weight in zip(value["keys"], weights):
            values[target] = minimum + spare * weight / sum(weights)
    return values


def apply(base: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with each dotted key set (missing sections are created)."""
    raw = copy.deepcopy(base)
    for dotted, value in values.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"space key {dotted!r}: {part!r} is not a section of the base config")
            node = child
        node[leaf] = value
    return raw


def preview(space: dict[str, Any]) -> dict[str, Any]:
    """One point of the space (first values, lower bounds, an even split), to check the
    resulting run config before anything is launched."""
    values: dict[str, Any] = {}
    for key, spec in space.items():
        kind, value = _spec(key, spec)
        if kind in ("choice", "grid"):
            values[key] = value[0]
        elif kind in ("uniform", "loguniform"):
            values[key] = float(value[0])
        elif kind == "randint":
            values[key] = int(value[0])
        else:
            for target in value["keys"]:
                values[target] = float(value["total"]) / len(value["keys"])
    return values


def swept_keys(space: dict[str, Any]) -> list[str]:
    """Every dotted key of the run config a trial may change."""
    keys: list[str] = []
    for key, spec in space.items():
        kind, value = _spec(key, spec)
        keys.extend(value["keys"] if kind == "simplex" else [key])
    return keys


def has_grid(space: dict[str, Any]) -> bool:
    return any(_spec(key, spec)[0] == "grid" for key, spec in space.items())
