"""YAML run configs → frozen dataclasses, with errors that name the offending key.

Every config file names its ``pipeline``; the pipeline module owns a frozen dataclass
describing the rest. Validation of values lives in each dataclass's ``__post_init__``;
this module checks structure: unknown keys, missing keys, nested sections, basic types.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from conclave.errors import ConclaveError

T = TypeVar("T")


class ConfigError(ConclaveError, ValueError):
    """A config (or a setting on the command line) that cannot describe a valid run; the message
    names the key. Fix it and run again."""

    exit_code = 2


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a section (mapping), got {value!r}")
        return from_dict(hint, value, where)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{where}: must be one of {list(typing.get_args(hint))}, got {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(hint)
        if origin is tuple and len(args) > 1 and args[-1] is not Ellipsis:  # fixed length, e.g. (prefix, lr)
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected a list of {len(args)} items, got {value!r}")
            return tuple(_coerce(v, h, f"{where}[{i}]") for i, (v, h) in enumerate(zip(value, args)))
        item_hint = args[0] if args else Any
        items = [_coerce(v, item_hint, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def as_base(section: Any, base: type[T], **changes: Any) -> T:
    """A section that extends one of learning's config dataclasses, as a plain ``base`` (its
    fields only, with ``changes``): what learning is handed, e.g. with the run's δ or seed."""
    given = {f.name: getattr(section, f.name) for f in dataclasses.fields(base) if f.init}
    return base(**{**given, **changes})


def from_dict(cls: type[T], data: dict[str, Any], where: str = "config") -> T:
    """Build dataclass ``cls`` from ``data``; unknown or missing keys are errors."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing required key '{name}'")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{where}: {err}") from err
