"""Signals held back while this process does what a ``KeyboardInterrupt`` must not cut in half.

Python raises ``KeyboardInterrupt`` at whatever bytecode runs when Ctrl-C lands, and some code
cannot take it there. Ray's compiled module runs Python code while it imports (Cython's
patching of ``collections.abc``) and reports a ``KeyboardInterrupt`` raised in it as "Exception
ignored", then goes on: a ``serve`` stopped then trained its teachers and served until killed
(1 start in about 150 in a sweep of the moment). A Ray import cut short also leaves an exit hook
that fails on the half-made module. And a child Ray forks runs Python's at-fork hooks before it
blocks SIGINT itself. A blocked signal stays pending and is delivered, once, when the block
ends: at a line of ours.
"""
from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterable, Iterator


@contextlib.contextmanager
def signals_held(signals: Iterable[signal.Signals]) -> Iterator[None]:
    """Block ``signals`` in this thread (and in the threads and processes it starts meanwhile:
    they inherit the mask), then restore the mask, which delivers what came meanwhile."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(signals))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
