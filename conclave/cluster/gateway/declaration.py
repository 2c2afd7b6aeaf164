"""The owner's own file for its gateway (``conclave owner serve OWNER.yaml``): its data, its declared
records, where it listens, its certificates, the peers it masks with, its Ray, the vote sources
it runs and how much teacher training it takes on (a coordinator asks within these). Loaded into frozen dataclasses with one-line errors naming the key.

This file is the owner's business, never the coordinator's: the coordinator names an owner by
endpoint and certificate only. The budget is not here either: it comes from the owner's policy on
this machine (``conclave owner init``), which the gateway requires before it serves.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from conclave.cluster.config import ConfigError, from_dict, load_yaml
from conclave.errors import InvalidValue
from conclave.learning.data.sources import DataSource

VOTE_SOURCES = ("clusters", "knn", "teachers")  # what a gateway can run


@dataclass(frozen=True)
class TlsFiles:
    """PEM paths: this gateway's certificate (common name = the owner) and key, and the consortium CA."""

    certificate: str
    key: str
    ca: str


@dataclass(frozen=True)
class RaySettings:
    """The owner's own Ray: ``local`` (an embedded one on this machine) or the address of the owner's cluster."""

    address: str = "local"
    num_cpus: int | None = None

    def __post_init__(self) -> None:
        if self.num_cpus is not None and self.num_cpus < 1:
            raise InvalidValue(f"num_cpus must be >= 1, got {self.num_cpus}")


@dataclass(frozen=True)
class Declaration:
    """One owner's gateway: ``name`` (its certificate's common name), its ``data`` (as an owner section
    of a run config gives it), the ``records`` it declares (public), ``listen`` (host:port), ``tls``,
    the ``peers`` of its consortium (by name) it takes part in secure sums with, its ``ray``, the
    ``actors`` its records are held on (or its teachers packed into), the ``vote_sources`` it admits,
    and the most teachers (``max_teachers``; None: one per declared record at most) and epochs
    (``max_epochs``) a run may have it train."""

    name: str
    data: DataSource
    records: int
    listen: str
    tls: TlsFiles
    peers: tuple[str, ...] = ()
    ray: RaySettings = field(default_factory=RaySettings)
    actors: int = 1
    vote_sources: tuple[str, ...] = VOTE_SOURCES
    max_teachers: int | None = None
    max_epochs: int = 100

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise InvalidValue(f"name {self.name!r}: use letters, digits, '-' and '_'")
        if self.records < 1:
            raise InvalidValue(f"records must be >= 1, got {self.records}")
        if not 1 <= self.actors <= self.records:
            raise InvalidValue(f"actors must be in [1, records], got {self.actors}")
        if self.name in self.peers or len(set(self.peers)) != len(self.peers):
            raise InvalidValue(f"peers must be distinct owners other than {self.name}, got {list(self.peers)}")
        if self.max_teachers is not None and not 1 <= self.max_teachers <= self.records:
            raise InvalidValue(f"max_teachers must be in [1, records], got {self.max_teachers}")
        if self.max_epochs < 1:
            raise InvalidValue(f"max_epochs must be >= 1, got {self.max_epochs}")
        unknown = sorted(set(self.vote_sources) - set(VOTE_SOURCES))
        if unknown:
            raise InvalidValue(f"vote_sources {unknown} are not known; known: {list(VOTE_SOURCES)}")
        self.host_port  # a bad listen address: an error now

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise InvalidValue(f"listen must be host:port, got {self.listen!r}")
        return host.strip("[]"), int(port)

    @property
    def teacher_limit(self) -> int:
        """The most teachers a run may have this owner train: each needs a record to learn from."""
        return self.records if self.max_teachers is None else self.max_teachers

    @property
    def parties(self) -> frozenset[str]:
        """The owners a round of this gateway may include: itself and its peers."""
        return frozenset((self.name, *self.peers))


def load_declaration(path: str | Path) -> Declaration:
    """The owner file at ``path``; relative paths in it are taken from its folder (``ConfigError``, one line)."""
    path = Path(path)
    declaration = from_dict(Declaration, load_yaml(path), str(path))
    base = str(path.resolve().parent)

    def anchored(file: str) -> str:
        return file if os.path.isabs(file) else os.path.normpath(os.path.join(base, file))

    tls = TlsFiles(*(anchored(p) for p in (declaration.tls.certificate, declaration.tls.key, declaration.tls.ca)))
    for setting, file in zip(("certificate", "key", "ca"), (tls.certificate, tls.key, tls.ca)):
        if not Path(file).is_file():
            raise ConfigError(f"{path}: tls.{setting}: no such file {file}")
    data: DataSource = declaration.data.anchored(base)
    return replace(declaration, data=data, tls=tls)
