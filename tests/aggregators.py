"""A real aggregator on 127.0.0.1 with a fresh ledger, for the aggregator tests."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

from conclave.actors.aggregator import AggregatorServer, ServerSettings
from conclave.privacy.accounting.charge import Neighbouring
from conclave.privacy.accounting.filter import RenyiFilter, filter_for
from conclave.privacy.accounting.ledger import PrivacyLedger
from conclave.privacy.mechanisms import build_mechanism

DELTA = 1e-5
INPUT_SHAPE = (1, 8, 8)  # scikit-learn's digits


def budget_for(mechanism, epsilon: float, queries: int = 1) -> RenyiFilter:
    """The budget a run declares for ``queries`` answers of ``mechanism`` at ε (before any vote)."""
    planned = mechanism.worst_case_charge(queries).for_records(Neighbouring.ADD_REMOVE, "one teacher per record")
    return filter_for(planned, epsilon, DELTA)


@contextlib.contextmanager
def serving(vote_source, ledger_path: Path, mechanism=None, budget: float | RenyiFilter | None = 50.0,
            ready: bool = True, **settings):
    """A started server (GNMax σ=2 by default) over ``vote_source`` with the ledger at
    ``ledger_path`` (``budget``: ε, a filter, or None for none); stopped afterwards."""
    mechanism = mechanism or build_mechanism("gnmax", sigma=2.0)
    if isinstance(budget, float):
        budget = budget_for(mechanism, budget)
    ledger = PrivacyLedger(ledger_path, DELTA, budget)
    server = AggregatorServer(vote_source, mechanism, ledger, INPUT_SHAPE, ServerSettings(**settings), ready=ready)
    address = server.start()
    try:
        yield server, address
    finally:
        server.stop()
        ledger.close()


def wait_for(condition, seconds: float, every: float = 0.1) -> None:
    """Poll ``condition`` until it holds, or fail after ``seconds`` (health moves on a timer)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(every)
    raise AssertionError(f"not within {seconds} s")
