"""A vote source that ships nowhere: its file (the section, the class) and one ``register`` call,
plus its section's key in a config (``ToyConfig``, as ``TeacherStudentConfig`` holds ``knn`` and
``clusters``). What validation and ``conclave plan`` need of it comes from the class
(tests/cluster/test_vote_sources.py). It starts nothing: the tests only check and plan with it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from conclave.cluster.owners import PublicData
from conclave.cluster.run_privacy import TRUSTED_AGGREGATOR
from conclave.cluster.teaching.config import TeacherStudentConfig
from conclave.cluster.teaching.vote_source import VoteSource

TOY_LEMMA = "toy: each teacher votes `copies` times, so one record's shard moves at most `copies` votes"


@dataclass(frozen=True)
class ToyVotes:
    copies: int = 2  # votes each teacher casts per query


class ToySource(VoteSource[TeacherStudentConfig]):
    section: ToyVotes
    kind: ClassVar[str] = "toy"
    section_type: ClassVar[type] = ToyVotes
    lemma: ClassVar[str] = TOY_LEMMA
    trust = TRUSTED_AGGREGATOR
    starting: ClassVar[str] = "starting nothing"

    def votes_per_query(self, config: TeacherStudentConfig) -> int:
        return self.section.copies * config.num_teachers

    def check(self, config: TeacherStudentConfig) -> None:
        if self.section.copies > config.num_teachers:
            raise ValueError(f"toy.copies ({self.section.copies}) exceeds the teachers ({config.num_teachers})")

    def check_gateway(self, config: TeacherStudentConfig) -> None:
        raise ValueError("toy votes do not go through gateways")

    def work(self, config: TeacherStudentConfig, mechanism: str) -> str:
        return f"{mechanism} on {config.student.queries} queries; toy votes, {self.section.copies} per teacher"

    def serving(self, pool: Any) -> str:
        return f"toy votes, {self.section.copies} per teacher"

    def start(self, config: TeacherStudentConfig, public: PublicData, progress: bool) -> Any:
        raise NotImplementedError("the toy source starts nothing")

    def gateway_terms(self, config: TeacherStudentConfig) -> tuple[Any, float, bool]:
        raise NotImplementedError("the toy source goes through no gateway")

    def described(self, config: TeacherStudentConfig, pool: Any) -> dict[str, Any]:
        return {"toy": {"copies": self.section.copies}}


@dataclass(frozen=True)
class ToyConfig(TeacherStudentConfig):
    """A run config with the toy's section beside the shipped ones."""

    toy: ToyVotes | None = None
