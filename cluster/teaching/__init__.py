"""The teacher/student library steps (PATE): owners' data → a teacher ensemble → a private
aggregator → a student, each with typed inputs (``config``) and typed results.

``conclave.cluster.api`` is the front door that re-exports them; ``conclave run`` (the
``teacher_student`` pipeline), ``conclave serve``, tuning and the benchmarks call them.
"""
