"""Group commit: concurrent requests served as one batch, with no added wait.

A caller that finds no batch running leads: it takes every request queued (its own first, up
to ``limit`` items) and runs ``work`` on them at once; callers arriving meanwhile queue, and
when the leader is done the first of them leads the next batch. A lone caller runs at once —
nothing waits for a window to fill — and under load each batch holds what arrived while the
one before it ran. The aggregator's labeller uses it so that concurrent ``Label`` calls share
one vote call to the teachers, one mechanism call and one ledger transaction (one fsync).
With ``merge=False`` each batch is one caller's item alone, still one batch at a time in arrival
order: for work whose result for one item depends on the others of its batch (public-cluster
votes), so that no caller's result depends on another's item.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar
from conclave.errors import InvalidValue

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass(eq=False)
class _Waiting(Generic[Item, Result]):
    item: Item
    size: int
    wake: threading.Event = field(default_factory=threading.Event)
    done: bool = False
    result: Result | None = None
    error: BaseException | None = None


class GroupCommit(Generic[Item, Result]):
    """``run(item)`` returns ``item``'s result from ``work(items) -> results`` (one per item, in
    order; an exception in place of a result is raised to that caller alone). An exception
    raised by ``work`` itself is raised to every caller of the batch and to every caller queued
    behind it: they would otherwise wait in turn on the same failure (a hung vote source would
    hold the last of them for several of its deadlines). ``size(item)`` counts an item against
    ``limit`` (a batch always takes at least one item); ``merge=False``: every batch is one item."""

    def __init__(self, work: Callable[[list[Item]], Sequence[Result | BaseException]], limit: int,
                 size: Callable[[Item], int] = lambda item: 1, merge: bool = True) -> None:
        if limit < 1:
            raise InvalidValue(f"limit must be >= 1, got {limit}")
        self._work, self._limit, self._size, self._merge = work, limit, size, merge
        self._lock = threading.Lock()
        self._queue: deque[_Waiting[Item, Result]] = deque()
        self._running = False  # invariant: not running ⇒ nothing queued

    def run(self, item: Item) -> Result:
        me: _Waiting[Item, Result] = _Waiting(item, self._size(item))
        with self._lock:
            self._queue.append(me)
            lead = not self._running
            self._running = True
        if not lead:
            me.wake.wait()  # set when our batch is done, or when we are first in line to lead
        if not me.done:
            self._lead()
        if me.error is not None:
            raise me.error
        return me.result  # type: ignore[return-value]

    def _lead(self) -> None:
        with self._lock:
            batch = [self._queue.popleft()]
            total = batch[0].size
            while self._merge and self._queue and total + self._queue[0].size <= self._limit:
                total += self._queue[0].size
                batch.append(self._queue.popleft())
        try:
            results = list(self._work([waiting.item for waiting in batch]))
            if len(results) != len(batch):
                raise RuntimeError(f"group work returned {len(results)} results for {len(batch)} items")
        except BaseException as err:
            failed: BaseException | None = err
            results = [err] * len(batch)
        else:
            failed = None
        with self._lock:
            if failed is not None:  # callers queued meanwhile would wait on the same failure: theirs too
                batch += self._queue
                results += [failed] * len(self._queue)
                self._queue.clear()
            for waiting, result in zip(batch, results):
                if isinstance(result, BaseException):
                    waiting.error = result
                else:
                    waiting.result = result
                waiting.done = True
                waiting.wake.set()
            if self._queue:
                self._queue[0].wake.set()  # the next in line leads
            else:
                self._running = False
