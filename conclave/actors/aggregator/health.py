"""Whether the aggregator's voters can vote: its health service and its Label calls follow it.

A failed vote turns it NOT_SERVING at once; a watcher thread then asks the vote source
(``ready``) until every voter can vote again, and SERVING comes back.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__package__)  # the aggregator's one log, whichever of its parts writes


class VoterHealth:
    """The watcher's view of the voters (``alive``), from ``check`` (the vote source's ``ready``)
    asked every ``interval`` s, and at once after a failed vote; ``publish`` on every change."""

    def __init__(self, check: Callable[..., bool], interval: float, publish: Callable[[], None]) -> None:
        self.alive = True  # every voter can vote
        self._check = check
        self._interval = interval
        self._publish = publish
        self._failures = 0  # vote failures reported so far; a check begun before the last one vouches for nothing
        self._wake = threading.Event()
        self._stopped = threading.Event()

    def failed(self) -> None:
        """A vote failed: NOT_SERVING now, and the watcher checks again soon."""
        self._failures += 1
        if self.alive:
            log.warning("teachers failed to vote: health NOT_SERVING until every teacher answers again")
        self.alive = False
        self._publish()
        self._wake.set()

    def start(self) -> None:
        self._stopped.clear()
        threading.Thread(target=self._watch, name="aggregator-health", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()

    def _watch(self) -> None:
        """Ask the vote source whether every voter can vote; health follows the answer."""
        interval = self._interval
        while not self._stopped.is_set():
            woken = self._wake.wait(interval)
            self._wake.clear()
            if self._stopped.is_set():
                return
            if woken and not self.alive:
                time.sleep(min(interval, 0.5))  # a failure was just reported; let the actor restart
            failures = self._failures
            try:
                alive = bool(self._check(timeout=interval))
            except Exception as err:  # a broken check means we cannot vouch for the teachers
                log.warning("teacher health check failed: %s", type(err).__name__)
                alive = False
            if alive and self._failures != failures:
                # A vote failed while this check ran (e.g. a probe answered by an actor just
                # resumed, its abandoned vote still running): the next check decides.
                continue
            if alive != self.alive:
                log.warning("teachers %s", "recovered: health SERVING" if alive else "lost: health NOT_SERVING")
                self.alive = alive
                self._publish()
