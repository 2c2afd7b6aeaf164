"""Named things a config or the command line can choose — models, data formats, selection
strategies, pipelines, commands — each registered as an import path, imported on first use.

    STRATEGIES: Registry[type[SelectionStrategy]] = Registry("selection strategy", {
        "random": "conclave.learning.selection.random:RandomSelection",
    })
    STRATEGIES.load("random")  # imports the module now; an unknown name is one line naming the known ones

A path is "module:attr" (that attribute) or "module" (the module itself). Holding the paths as
strings keeps a registry free to import: ``conclave plan`` reads configs without torch, and
``conclave analyze`` starts without Ray.

This module sits in the root package, under no layer, and imports nothing of the project, so
every layer (privacy, learning, ...) may use it without breaking their one-way order.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar, cast
from conclave.errors import InvalidValue

T = TypeVar("T")


class UnknownName(KeyError, ValueError):
    """A name a registry does not hold. A ``KeyError`` as for any mapping, and a ``ValueError``
    as for any bad setting; its message is one line naming the known ones."""

    def __str__(self) -> str:
        return str(self.args[0])  # KeyError's own quotes the message as a repr


class MissingAttribute(AttributeError):
    """An import path whose module imports but has no such attribute (told apart from an
    ``AttributeError`` raised while the module itself was imported): ``obj`` is the module,
    ``name`` the attribute."""


def imported(path: str) -> Any:
    """What "module:attr" names, or the module "module" names, importing it now. Whatever the
    import raises passes through; a missing attribute is ``MissingAttribute``."""
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    if not attr:
        return module
    try:
        return getattr(module, attr)
    except AttributeError:
        raise MissingAttribute(f"module {module_name!r} ({module.__file__}) has no {attr!r}",
                               name=attr, obj=module) from None


def import_path(value: Any) -> str:
    """The "module:qualname" ``imported`` would take for ``value`` (a user's function or class, or
    any callable: a ``functools.partial`` has no name of its own, so its type's stands in)."""
    return f"{getattr(value, '__module__', None) or '?'}:{getattr(value, '__qualname__', type(value).__name__)}"


class Registry(Mapping[str, str], Generic[T]):
    """Names → import paths of one ``kind`` of thing (a read-only mapping); ``load`` imports one.

    ``about``: an optional one-line description per name (e.g. a command's help), readable
    without importing anything."""

    def __init__(self, kind: str, paths: Mapping[str, str], about: Mapping[str, str] | None = None) -> None:
        undescribed = sorted(set(about or {}) - set(paths))
        if undescribed:
            raise InvalidValue(f"{kind} registry: descriptions of unregistered names {undescribed}")
        self.kind = kind
        self._paths = dict(paths)
        self._about = dict(about or {})

    def __getitem__(self, name: str) -> str:
        try:
            return self._paths[name]
        except KeyError:
            raise UnknownName(f"unknown {self.kind} {name!r}; known: {', '.join(self.names)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._paths

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self._paths!r})"

    @classmethod
    def described(cls, kind: str, entries: Mapping[str, tuple[str, str]]) -> Registry[T]:
        """A registry from name → (import path, one-line description): one line per name."""
        return cls(kind, {name: path for name, (path, _) in entries.items()},
                   {name: text for name, (_, text) in entries.items()})

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._paths))

    def path(self, name: str) -> str:
        """The import path registered as ``name`` (``UnknownName`` if none is)."""
        return self[name]

    def about(self, name: str) -> str:
        """The one-line description of ``name`` ("" when it has none)."""
        self.path(name)  # an unknown name is UnknownName, as for load
        return self._about.get(name, "")

    def load(self, name: str) -> T:
        """The object registered as ``name``, imported now (``UnknownName`` if none is)."""
        return cast(T, imported(self.path(name)))
