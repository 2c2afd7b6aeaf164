"""Ray Tune sweeps over Conclave's privacy/accuracy knobs, with the tuning's own privacy cost.

``conclave tune CONFIG`` (``tuning.command``) reads a sweep (``tuning.config``), builds its
search space (``tuning.spaces``), runs trials (``tuning.trainables``) through Ray Tune
(``tuning.sweep``) and writes the table, plot and cost (``tuning.report``). The cost of
choosing among trials is ``privacy.accounting.tuning_cost``.
"""
