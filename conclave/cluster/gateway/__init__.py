"""The owner's gateway (``conclave owner serve``) and the coordinator's client of it.

Each owner runs its gateway on its own machine with its own Ray; a coordinator reaches the owner
only through the owner protocol (``protos/owner.proto``) over mutual TLS: ``declaration`` (the
owner's own file), ``identity`` (signed round keys), ``wire`` (the messages decoded and checked),
``servicer`` (the calls), ``runs`` (a run's admission and ledger), ``vote_runs`` and ``dpsgd_runs``
(each kind of run's rounds), ``server`` (gRPC), ``client`` (the coordinator's side).
"""
