"""The teacher/student library steps (PATE): owners' data → a vote source → a private aggregator →
a student, each with typed inputs (``config``) and typed results.

``VOTE_SOURCES`` is the registry of what may vote (``vote_source.VoteSource``): adding a vote source
is its file (its class) and one line in ``register``'s list below, plus its section in
``teaching.config`` (the dataclass and its key in ``TeacherStudentConfig``, as for ``knn``). ``conclave.cluster.api`` is the front door that
re-exports the steps; ``conclave run`` (the ``teacher_student`` pipeline), ``conclave serve``, tuning
and the benchmarks call them.
"""
from conclave.cluster.teaching.clusters import ClustersSource
from conclave.cluster.teaching.knn import KnnSource
from conclave.cluster.teaching.teachers import TeachersSource
from conclave.cluster.teaching.vote_source import DEFAULT_SOURCE, VOTE_SOURCES, VoteSource, chosen, register

__all__ = ["DEFAULT_SOURCE", "VOTE_SOURCES", "VoteSource", "chosen", "register"]

for shipped in (TeachersSource, KnnSource, ClustersSource):
    register(shipped)
