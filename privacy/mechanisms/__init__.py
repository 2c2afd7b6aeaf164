"""Vote mechanisms: one file each, all behind ``privacy.mechanisms.base.VoteMechanism``.

``build_mechanism`` turns the CLI/config parameters into a mechanism, so every entry point
(``conclave analyze``, the aggregator, pipelines) accepts the same names.
"""
from __future__ import annotations

from privacy.mechanisms.base import ABSTAIN, MechanismResult, VoteMechanism
from privacy.mechanisms.confident_gnmax import ConfidentGNMax
from privacy.mechanisms.gnmax import GNMax
from privacy.mechanisms.lnmax import LNMax
from privacy.mechanisms.nzc import NZC, nzc_report
from privacy.mechanisms.stability import Stability

__all__ = [
    "ABSTAIN", "MechanismResult", "VoteMechanism", "LNMax", "GNMax", "ConfidentGNMax", "NZC",
    "Stability", "nzc_report", "build_mechanism", "MECHANISMS",
]

# name -> (class, {parameter name as given by callers: constructor argument})
_PARAMETERS = {
    "lnmax": (LNMax, {"laplace_scale": "laplace_scale"}),
    "gnmax": (GNMax, {"sigma": "sigma"}),
    # the CLI's --sigma is σ2 for confident-gnmax (the GNMax step after the threshold)
    "confident-gnmax": (
        ConfidentGNMax,
        {"sigma1": "sigma1", "threshold": "threshold", "sigma": "sigma2", "sigma2": "sigma2"},
    ),
    "nzc": (NZC, {"constant": "constant", "laplace_scale": "laplace_scale", "sigma": "sigma"}),
    "stability": (
        Stability,
        {"epsilon": "epsilon", "delta": "delta", "max_unstable": "max_unstable", "max_queries": "max_queries"},
    ),
}
MECHANISMS = tuple(_PARAMETERS)


def build_mechanism(name: str, **params) -> VoteMechanism:
    """The mechanism called ``name`` with ``params``; parameters set to None are ignored.

    Raises ValueError naming the problem: unknown mechanism, a parameter it does not take,
    or a missing one.
    """
    if name not in _PARAMETERS:
        raise ValueError(f"unknown mechanism {name!r}; choose one of {', '.join(MECHANISMS)}")
    cls, accepted = _PARAMETERS[name]
    given = {key: value for key, value in params.items() if value is not None}
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise ValueError(f"{name} does not take {', '.join(unknown)}; it takes {', '.join(sorted(accepted))}")
    kwargs = {accepted[key]: value for key, value in given.items()}
    try:
        return cls(**kwargs)
    except TypeError as error:  # a required parameter is missing
        raise ValueError(f"{name}: missing parameter ({error})") from None
