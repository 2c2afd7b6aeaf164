"""Vote mechanisms: one file each, all behind ``privacy.mechanisms.base.VoteMechanism``.

``MECHANISMS`` is the one registry: adding a mechanism is its file and one line here.
``build_mechanism`` turns CLI/config parameters into a mechanism, so every entry point
(``conclave analyze``, the aggregator, pipelines) accepts the same names; ``secure_mechanism``
gives its variant over secure-sum vote totals (``aggregation: secure``), where it has one.
"""
from __future__ import annotations

import dataclasses

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
# numpy-only modules, and validating any config reads their class attributes (``name``, fields,
# ``aliases``, ``secure_variant``) anyway, so importing them late would save nothing.
MECHANISMS: dict[str, type] = {cls.name: cls for cls in (LNMax, GNMax, ConfidentGNMax, NZC, Stability,
                                                          PrivateKnnMechanism, PublicClusterVotes)}
SECURE_MECHANISMS = tuple(name for name, cls in MECHANISMS.items() if cls.secure_variant is not None)

__all__ = [
    "ABSTAIN", "Description", "MechanismResult", "VoteMechanism", "SecureVoteMechanism", "LNMax", "GNMax",
    "ConfidentGNMax", "NZC", "Stability", "PrivateKnnMechanism", "PublicClusterVotes", "SecureGNMax",
    "SecureConfidentGNMax", "SecurePrivateKnn", "SecurePublicClusterVotes", "build_mechanism",
    "parameter_names", "secure_mechanism", "MECHANISMS", "SECURE_MECHANISMS",
]


def parameter_names(name: str) -> dict[str, str]:
    """Accepted parameter names of mechanism ``name`` → constructor argument (aliases included)."""
    cls = MECHANISMS[name]
    own = {f.name: f.name for f in dataclasses.fields(cls) if f.init}
    return {**own, **cls.aliases}


def build_mechanism(name: str, **params) -> VoteMechanism:
    """The mechanism called ``name`` with ``params``; parameters set to None are ignored.

    Raises ValueError naming the problem: unknown mechanism, a parameter it does not take,
    or a missing one.
    """
    if name not in MECHANISMS:
        raise ValueError(f"unknown mechanism {name!r}; choose one of {', '.join(MECHANISMS)}")
    accepted = parameter_names(name)
    given = {key: value for key, value in params.items() if value is not None}
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise ValueError(f"{name} does not take {', '.join(unknown)}; it takes {', '.join(sorted(accepted))}")
    kwargs = {accepted[key]: value for key, value in given.items()}
    required = [f.name for f in dataclasses.fields(MECHANISMS[name])
                if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [p for p in required if p not in kwargs]
    if missing:
        raise ValueError(f"{name}: missing parameter(s) {', '.join(missing)}")
    return MECHANISMS[name](**kwargs)


def secure_mechanism(mechanism: VoteMechanism) -> SecureVoteMechanism:
    """The variant of ``mechanism`` over secure-sum vote totals, with the same parameters; ValueError
    (one line naming the mechanisms that have one) when it needs clean histograms."""
    if mechanism.secure_variant is None:
        raise ValueError(f"mechanism {mechanism.name} needs clean vote histograms, which aggregation: secure never "
                         f"shows the aggregator; use one of {', '.join(SECURE_MECHANISMS)}")
    return mechanism.secure_variant(**parameters_of(mechanism))
