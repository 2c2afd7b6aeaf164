"""Vote mechanisms: one file each, all behind ``privacy.mechanisms.base.VoteMechanism``.

``MECHANISMS`` is the one registry: adding a mechanism is its file and one line in ``register``'s
list below; everything else that configs, ``conclave plan`` and ``conclave analyze`` need comes
from the class, checked here when it is registered. ``build_mechanism`` turns CLI/config
parameters into a mechanism, so every entry point (``conclave analyze``, the aggregator,
pipelines) accepts the same names; ``secure_mechanism`` gives its variant over secure-sum vote
totals (``aggregation: secure``), where it has one.
"""
from __future__ import annotations

import dataclasses
import inspect

from conclave.errors import InvalidValue
from conclave.privacy.mechanisms.base import (ABSTAIN, Description, MechanismResult, SecureVoteMechanism,
                                              VoteMechanism, parameters_of)
from conclave.privacy.mechanisms.confident_gnmax import ConfidentGNMax, SecureConfidentGNMax
from conclave.privacy.mechanisms.gnmax import GNMax, SecureGNMax
from conclave.privacy.mechanisms.lnmax import LNMax
from conclave.privacy.mechanisms.nzc import NZC
from conclave.privacy.mechanisms.private_knn import PrivateKnnMechanism, SecurePrivateKnn
from conclave.privacy.mechanisms.public_clusters import PublicClusterVotes, SecurePublicClusterVotes
from conclave.privacy.mechanisms.stability import Stability

# Classes, not a lazy ``conclave.registry.Registry`` of import paths: the mechanisms are small
# numpy-only modules, and validating any config reads their class attributes anyway, so
# importing them late would save nothing.
MECHANISMS: dict[str, type[VoteMechanism]] = {}
SECURE_MECHANISMS: tuple[str, ...] = ()  # the names of those with a variant over secure-sum totals

__all__ = [
    "ABSTAIN", "Description", "MechanismResult", "VoteMechanism", "SecureVoteMechanism", "LNMax", "GNMax",
    "ConfidentGNMax", "NZC", "Stability", "PrivateKnnMechanism", "PublicClusterVotes", "SecureGNMax",
    "SecureConfidentGNMax", "SecurePrivateKnn", "SecurePublicClusterVotes", "build_mechanism",
    "parameter_names", "register", "secure_mechanism", "MECHANISMS", "SECURE_MECHANISMS",
]


def register(cls: type[VoteMechanism]) -> type[VoteMechanism]:
    """Make ``cls`` a mechanism configs can name, once it describes itself fully: a concrete
    ``VoteMechanism`` dataclass with a new ``name``, one line of ``help`` per parameter, and
    aliases, pairings, noise parameters, defaults and a secure variant that fit its parameters
    (TypeError naming what does not). Returns ``cls``."""
    global SECURE_MECHANISMS
    problems = _problems(cls)
    if problems:
        raise TypeError(f"mechanism class {cls.__name__} cannot be registered: {'; '.join(problems)}")
    MECHANISMS[cls.name] = cls
    SECURE_MECHANISMS = tuple(name for name, known in MECHANISMS.items() if known.secure_variant is not None)
    return cls


def _problems(cls: type) -> list[str]:
    """What keeps ``cls`` from being registered (nothing: it may be)."""
    if not (isinstance(cls, type) and issubclass(cls, VoteMechanism) and dataclasses.is_dataclass(cls)):
        return ["it is not a dataclass subclass of privacy.mechanisms.base.VoteMechanism"]
    if inspect.isabstract(cls):
        return [f"it does not implement {', '.join(sorted(cls.__abstractmethods__))}"]
    name, parameters = getattr(cls, "name", None), _parameters(cls)
    problems = []
    if not (isinstance(name, str) and name):
        problems.append("it has no name")
    elif MECHANISMS.get(name, cls) is not cls:
        problems.append(f"the name {name!r} is {MECHANISMS[name].__name__}'s")
    if set(getattr(cls, "help", {})) != set(parameters):
        problems.append(f"its help must explain exactly its parameters {sorted(parameters)}")
    if any(alias in parameters or target not in parameters for alias, target in cls.aliases.items()):
        problems.append("each alias must name a parameter by another name")
    for attribute in ("paired_with", "noise"):
        if not set(getattr(cls, attribute)) <= set(parameters):
            problems.append(f"its {attribute} must be parameters of it")
    if not set(cls.defaults(1)) <= set(parameters):
        problems.append("its defaults must be parameters of it")
    if not all(isinstance(getattr(cls, flag), bool) for flag in ("stateless", "smooth_sensitivity_analysis")):
        problems.append("stateless and smooth_sensitivity_analysis must be True or False")
    if cls.smooth_sensitivity_analysis and not callable(getattr(cls, "smooth_sensitivity_terms", None)):
        problems.append("smooth_sensitivity_analysis needs a smooth_sensitivity_terms method")
    secure = cls.secure_variant
    if secure is not None and not (isinstance(secure, type) and issubclass(secure, SecureVoteMechanism)
                                   and not inspect.isabstract(secure) and dataclasses.is_dataclass(secure)
                                   and _parameters(secure) == parameters
                                   and secure.paired_with == cls.paired_with):
        problems.append("its secure_variant must be a SecureVoteMechanism dataclass with the same parameters and "
                        "pairings")
    return problems


def _parameters(cls: type) -> list[str]:
    """A dataclass mechanism's constructor arguments, in order."""
    return [f.name for f in dataclasses.fields(cls) if f.init]


for shipped in (LNMax, GNMax, ConfidentGNMax, NZC, Stability, PrivateKnnMechanism, PublicClusterVotes):
    register(shipped)


def parameter_names(name: str) -> dict[str, str]:
    """Accepted parameter names of mechanism ``name`` → constructor argument (aliases included)."""
    cls = MECHANISMS[name]
    return {**{parameter: parameter for parameter in _parameters(cls)}, **cls.aliases}


def build_mechanism(name: str, **params) -> VoteMechanism:
    """The mechanism called ``name`` with ``params``; parameters set to None are ignored.

    Raises ValueError naming the problem: unknown mechanism, a parameter it does not take,
    or a missing one.
    """
    if name not in MECHANISMS:
        raise InvalidValue(f"unknown mechanism {name!r}; choose one of {', '.join(MECHANISMS)}")
    accepted = parameter_names(name)
    given = {key: value for key, value in params.items() if value is not None}
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise InvalidValue(f"{name} does not take {', '.join(unknown)}; it takes {', '.join(sorted(accepted))}")
    kwargs = {accepted[key]: value for key, value in given.items()}
    required = [f.name for f in dataclasses.fields(MECHANISMS[name])
                if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [p for p in required if p not in kwargs]
    if missing:
        raise InvalidValue(f"{name}: missing parameter(s) {', '.join(missing)}")
    return MECHANISMS[name](**kwargs)


def secure_mechanism(mechanism: VoteMechanism) -> SecureVoteMechanism:
    """The variant of ``mechanism`` over secure-sum vote totals, with the same parameters; ValueError
    (one line naming the mechanisms that have one) when it needs clean histograms."""
    if mechanism.secure_variant is None:
        raise InvalidValue(f"mechanism {mechanism.name} needs clean vote histograms, which aggregation: secure never "
                         f"shows the aggregator; use one of {', '.join(SECURE_MECHANISMS)}")
    return mechanism.secure_variant(**parameters_of(mechanism))
