"""The one interface every vote source implements: what votes on the student's queries (teachers, the
owners' records through kNN, public clusters), and all that configs, ``plan``, ``serve``, the
aggregator, the gateways and the student need to know of it. A source is registered
(``cluster.teaching.VOTE_SOURCES``) and checked when it is; the config, the library steps, ``plan``
and ``serve`` ask ``config.vote_source`` rather than branch on which it is.
"""
from __future__ import annotations

import abc
import dataclasses
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from conclave.cluster.run_privacy import TrustModel
from conclave.errors import InvalidValue

if TYPE_CHECKING:  # loading a config needs neither torch nor Ray
    from conclave.cluster.owners import PublicData
    from conclave.learning.embeddings import Embedding

# The run's config (``teaching.config.TeacherStudentConfig``), which imports this module: a parameter here.
C = TypeVar("C")

VOTE_SOURCES: dict[str, type[VoteSource[Any]]] = {}  # kind → class; the kind is the config section choosing it
DEFAULT_SOURCE = "teachers"  # what votes when no other source's section is set


@dataclass(frozen=True)
class VoteSource(abc.ABC, Generic[C]):
    """A registered vote source over its config ``section`` (the dataclass ``section_type``), for a
    run's config ``C``."""

    section: Any
    kind: ClassVar[str]  # its config section's key, e.g. "knn"
    section_type: ClassVar[type]
    lemma: ClassVar[str]  # why one record moves at most what the charges assume (the cell bound, m, ...)
    trust: ClassVar[TrustModel]  # who sees clean votes under aggregation: trusted-aggregator
    records_vote: ClassVar[bool] = False  # the owners' records vote themselves: no teacher trains
    # what a trusted aggregator over several owners would see (None: their clean votes may meet there)
    clean_votes: ClassVar[str | None] = None
    paired: ClassVar[tuple[str, ...]] = ()  # its settings that a mechanism's charge holds for (paired_with)
    asks_in_embedding: ClassVar[bool] = False  # the student chooses its queries in the source's embedding
    starting: ClassVar[str]  # the progress line while it starts in the cluster

    def supplies(self) -> dict[str, float]:
        """Its ``paired`` settings' values, which the mechanism is charged at."""
        return {name: getattr(self.section, name) for name in self.paired}

    @abc.abstractmethod
    def votes_per_query(self, config: C) -> int:
        """Votes per query as the config declares them (what a mechanism's defaults scale with)."""

    def check(self, config: C) -> None:
        """Its checks of the whole config beyond its section's own (ValueError, one line)."""

    def asked(self, config: C) -> Any:
        """The student's settings (``StudentConfig``) with this source: the config's by default."""
        selection = config.student.selection
        if selection.spread_medoids > 1 or selection.spread_margin > 0:
            raise InvalidValue("student.selection.spread_medoids spreads public-cluster votes' labels: it needs a "
                             "clusters section")
        return config.student

    @abc.abstractmethod
    def check_gateway(self, config: C) -> None:
        """What behind the owners' gateways needs of the config (ValueError, one line)."""

    @abc.abstractmethod
    def work(self, config: C, mechanism: str) -> str:
        """``conclave plan``'s line of the planned work; ``mechanism``: its name and parameters."""

    @abc.abstractmethod
    def serving(self, pool: Any) -> str:
        """``conclave serve``'s few words of what votes, given the started ``pool``."""

    @abc.abstractmethod
    def start(self, config: C, public: PublicData, progress: bool) -> Any:
        """Its vote actors in the cluster, ready to vote (Ray running): the aggregator's pool."""

    @abc.abstractmethod
    def gateway_terms(self, config: C) -> tuple[Any, float, bool]:
        """What each owner's gateway admits: (the terms, the mechanism's σ, whether the pool goes there)."""

    def student_embedding(self, pool: Any) -> Embedding | None:
        """The embedding the student chooses queries in (``asks_in_embedding``): the pool's."""
        return pool.embed if self.asks_in_embedding else None

    @abc.abstractmethod
    def described(self, config: C, pool: Any) -> dict[str, Any]:
        """What voted, for the run's metrics (``pool``: the started source)."""


def register(cls: type[VoteSource]) -> type[VoteSource]:
    """Make ``cls`` a vote source configs can choose, once it describes itself fully (TypeError
    naming what does not). Returns ``cls``."""
    problems = _problems(cls)
    if problems:
        raise TypeError(f"vote source class {cls.__name__} cannot be registered: {'; '.join(problems)}")
    VOTE_SOURCES[cls.kind] = cls
    return cls


def _problems(cls: type) -> list[str]:
    if not (isinstance(cls, type) and issubclass(cls, VoteSource)):
        return ["it is not a subclass of cluster.teaching.vote_source.VoteSource"]
    if inspect.isabstract(cls):
        return [f"it does not implement {', '.join(sorted(cls.__abstractmethods__))}"]
    problems = []
    missing = [name for name in ("kind", "section_type", "lemma", "trust", "starting") if not hasattr(cls, name)]
    if missing:
        return [f"it does not say its {', '.join(missing)}"]
    if not (isinstance(cls.kind, str) and cls.kind):
        problems.append("it has no kind")
    elif VOTE_SOURCES.get(cls.kind, cls) is not cls:
        problems.append(f"the kind {cls.kind!r} is {VOTE_SOURCES[cls.kind].__name__}'s")
    if not dataclasses.is_dataclass(cls.section_type):
        problems.append("its section_type must be a config dataclass")
    elif not set(cls.paired) <= {f.name for f in dataclasses.fields(cls.section_type)}:
        problems.append("its paired settings must be fields of its section")
    if cls.records_vote and cls.clean_votes is None:
        problems.append("records that vote themselves must say what their clean votes would show (clean_votes)")
    return problems


def chosen(config: C) -> VoteSource[C]:
    """The source ``config`` chooses: the one registered source whose section it sets (teachers
    when none is; ValueError when several are)."""
    sections = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                if f.name in VOTE_SOURCES and f.name != DEFAULT_SOURCE}
    given = [kind for kind, section in sections.items() if section is not None]
    if len(given) > 1:
        raise InvalidValue(f"choose one vote source: {' or '.join(sections)}")
    kind = given[0] if given else DEFAULT_SOURCE
    return VOTE_SOURCES[kind](getattr(config, kind))
