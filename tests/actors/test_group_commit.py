"""Concurrent Label calls answered together: one vote call, one mechanism call and one ledger
transaction per group (``actors.group_commit``), each call still getting its own answers and
the budget paid in the order the calls arrived. Real teacher actors (``teachers`` fixture)."""
from __future__ import annotations

import threading
import time
from concurrent import futures

import numpy as np
import pytest

from conclave.actors.group_commit import GroupCommit
from conclave.actors.labeller import PrivateLabeller
from conclave.privacy.accounting.filter import RenyiFilter
from conclave.privacy.accounting.ledger import BudgetExceeded, PrivacyLedger, read_history
from conclave.privacy.accounting.rdp import epsilon_from_rdp
from conclave.privacy.mechanisms import build_mechanism
from tests.aggregators import DELTA

ORDER, SIGMA = 16.0, 8.0


def test_a_lone_call_runs_at_once_and_calls_arriving_meanwhile_share_the_next_batch():
    batches: list[list[int]] = []
    started = threading.Event()

    def work(items: list[int]) -> list[int | BaseException]:
        batches.append(items)
        started.set()
        time.sleep(0.3)  # long enough for every other caller to queue behind the first batch
        return [ValueError(f"odd {item}") if item % 2 else item * 10 for item in items]

    group: GroupCommit[int, int] = GroupCommit(work, limit=5)
    assert group.run(2) == 20 and batches == [[2]]  # alone: no wait for company
    batches.clear()
    with futures.ThreadPoolExecutor(9) as pool:
        first = pool.submit(group.run, 0)
        started.wait(5)
        later = [pool.submit(group.run, item) for item in range(1, 9)]
        time.sleep(0.1)
        assert first.result() == 0
        outcomes = [f.exception() or f.result() for f in later]
    assert [str(o) if isinstance(o, Exception) else o for o in outcomes] == \
        ["odd 1", 20, "odd 3", 40, "odd 5", 60, "odd 7", 80]  # each caller its own result or error
    assert batches[0] == [0] and [len(b) for b in batches[1:]] == [5, 3]  # the limit splits the rest
    assert sorted(sum(batches[1:], [])) == list(range(1, 9))



def test_without_merging_each_caller_is_a_batch_of_its_own_in_arrival_order():
    """For work coupled across a batch (public-cluster votes): no caller's result may depend on another's item."""
    batches: list[list[int]] = []
    started = threading.Event()

    def work(items: list[int]) -> list[int]:
        batches.append(items)
        started.set()
        time.sleep(0.2)
        return [item * 10 for item in items]

    group: GroupCommit[int, int] = GroupCommit(work, limit=5, merge=False)
    with futures.ThreadPoolExecutor(4) as pool:
        first = pool.submit(group.run, 0)
        started.wait(5)
        later = []
        for item in (1, 2, 3):
            later.append(pool.submit(group.run, item))
            time.sleep(0.02)  # a known arrival order
        assert [call.result() for call in [first, *later]] == [0, 10, 20, 30]
    assert batches == [[0], [1], [2], [3]]

def test_a_failure_of_the_work_reaches_its_batch_and_every_caller_queued_behind_it():
    calls = 0

    def work(items: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            time.sleep(0.2)  # a hung vote source: the others queue meanwhile
            raise RuntimeError("teachers down")
        return items

    group: GroupCommit[int, int] = GroupCommit(work, limit=100)
    with futures.ThreadPoolExecutor(4) as pool:
        first = pool.submit(group.run, 1)
        time.sleep(0.05)
        queued = [pool.submit(group.run, item) for item in (2, 3, 4)]
        for call in [first, *queued]:  # none waits for a second try at the same failure
            with pytest.raises(RuntimeError, match="teachers down"):
                call.result()
    assert calls == 1
    assert group.run(5) == 5  # a later call runs as usual


class _Counting:
    """The real teacher pool, counting how often it is asked to vote and for how many inputs."""

    def __init__(self, pool) -> None:
        self.pool, self.calls = pool, []
        self.num_classes, self.votes_per_query, self.batch_coupled = pool.num_classes, pool.votes_per_query, False
        self.local = False
        self.neighbouring, self.neighbouring_lemma = pool.neighbouring, pool.neighbouring_lemma

    def votes(self, inputs: np.ndarray) -> np.ndarray:
        self.calls.append(len(inputs))
        time.sleep(0.05)  # teachers busy long enough for concurrent calls to queue
        return self.pool.votes(inputs)


def room_for(answers: float) -> RenyiFilter:
    return RenyiFilter(epsilon_from_rdp([ORDER], [answers * ORDER / SIGMA**2], DELTA)[0], DELTA, ORDER)


@pytest.fixture(scope="module")
def public(teachers) -> np.ndarray:
    from conclave.learning.data import load_digits

    return load_digits()[1].x


def test_concurrent_calls_share_vote_calls_and_ledger_transactions(teachers, public, tmp_path):
    source = _Counting(teachers)
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite", DELTA, room_for(1000))
    labeller = PrivateLabeller(source, build_mechanism("gnmax", sigma=SIGMA), ledger)
    with futures.ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(lambda i: labeller.label(public[i:i + 1]), range(32)))
    assert all(o.answered == 1 for o in outcomes)
    assert sum(source.calls) == 32 and len(source.calls) < 32  # grouped: fewer vote calls than calls
    charges = read_history(ledger.path)
    assert len(charges) == len(source.calls)  # one ledger transaction per group
    assert sum(c.charge.rdp[list(c.charge.orders).index(ORDER)] for c in charges) == pytest.approx(32 * ORDER / SIGMA**2)
    again = [labeller.label(public[i:i + 1]).labels[0] for i in range(32)]
    assert again == [o.labels[0] for o in outcomes]  # each call got its own input's answer
    assert labeller.budget().cache_hits == 32
    ledger.close()


def test_the_budget_pays_concurrent_calls_in_turn_and_refuses_the_rest_whole(teachers, public, tmp_path):
    source = _Counting(teachers)
    ledger = PrivacyLedger(tmp_path / "ledger.sqlite", DELTA, room_for(10.5))
    labeller = PrivateLabeller(source, build_mechanism("gnmax", sigma=SIGMA), ledger)

    def ask(i: int) -> int | str:
        try:
            return labeller.label(public[2 * i:2 * i + 2]).answered
        except BudgetExceeded as err:
            return str(err)

    with futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(ask, range(12)))
    answered = [r for r in results if isinstance(r, int)]
    assert sum(answered) == 10 and answered.count(1) <= 1  # at most one call answered in part
    refused = [r for r in results if isinstance(r, str)]
    assert refused and all("privacy budget exhausted" in r for r in refused)
    # Each refusal counts its own call's inputs, never its group's: that would tell a caller how
    # many other clients asked meanwhile.
    assert all("labelling 2 new inputs" in r for r in refused), refused
    assert ledger.report().epsilon_spent <= ledger.report().epsilon_limit
    ledger.close()
