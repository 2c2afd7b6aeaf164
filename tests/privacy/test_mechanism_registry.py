"""Registering a mechanism checks that its class describes itself: a name of its own, help for
exactly its parameters, and pairings, noise, defaults and a secure variant that fit them; a
refused class leaves the registry as it was. The shipped mechanisms pass the same checks."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest

from conclave.privacy.mechanisms import MECHANISMS, SECURE_MECHANISMS, SecureGNMax, VoteMechanism, register
from tests.toy_mechanism import ToyMax


@dataclass(frozen=True)
class Unhelpful(ToyMax):
    name: ClassVar[str] = "unhelpful"
    help: ClassVar[dict[str, str]] = {"sigma": "noise sigma"}


@dataclass(frozen=True)
class NoisyElsewhere(ToyMax):
    name: ClassVar[str] = "noisy-elsewhere"
    noise: ClassVar[tuple[str, ...]] = ("sigma", "temperature")


@dataclass(frozen=True)
class Impostor(ToyMax):
    name: ClassVar[str] = "gnmax"


@dataclass(frozen=True)
class Mismatched(ToyMax):
    name: ClassVar[str] = "mismatched"
    secure_variant: ClassVar[type] = SecureGNMax  # takes sigma alone, not sigma and floor


@dataclass(frozen=True)
class Unfinished(VoteMechanism):
    sigma: float
    name: ClassVar[str] = "unfinished"
    help: ClassVar[dict[str, str]] = {"sigma": "noise sigma"}


@pytest.mark.parametrize("cls, problem", [
    (dict, "it is not a dataclass subclass of privacy.mechanisms.base.VoteMechanism"),
    (Unfinished, "it does not implement __call__, describe, run_charge, worst_case_charge"),
    (Unhelpful, "its help must explain exactly its parameters ['floor', 'sigma']"),
    (NoisyElsewhere, "its noise must be parameters of it"),
    (Impostor, "the name 'gnmax' is GNMax's"),
    (Mismatched, "its secure_variant must be a SecureVoteMechanism dataclass with the same parameters"),
])
def test_a_class_that_does_not_describe_itself_is_refused_in_one_line(cls, problem):
    known = dict(MECHANISMS)
    with pytest.raises(TypeError, match=f"^mechanism class {cls.__name__} cannot be registered: ") as refused:
        register(cls)
    assert problem in str(refused.value) and "\n" not in str(refused.value)
    assert MECHANISMS == known and SECURE_MECHANISMS == ("gnmax", "confident-gnmax", "private-knn", "public-clusters")


def test_a_registered_class_is_built_by_name_and_fills_its_own_defaults():
    register(ToyMax)
    try:
        assert MECHANISMS["toy-max"] is ToyMax and register(ToyMax) is ToyMax  # registering again: the same
        assert ToyMax.defaults(10) == {"floor": 5.0} and ToyMax(5.0, 2.0).warnings(4) == [
            "toy-max sigma 5 is at least the 4 teachers: the noise outweighs even a unanimous vote's margin"]
    finally:
        MECHANISMS.pop("toy-max")
    for cls in MECHANISMS.values():  # the shipped ones describe themselves as fully
        assert register(cls) is cls and set(cls.help) == {f.name for f in dataclasses.fields(cls) if f.init}
