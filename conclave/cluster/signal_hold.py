"""Signals held back while this process does what a ``KeyboardInterrupt`` must not cut in half.

Python raises ``KeyboardInterrupt`` at whatever bytecode runs when Ctrl-C lands, and an import
cannot always take it there. Measured by Ctrl-C at random moments of a start: Ray's compiled
module runs Python code while it imports (Cython's patching of ``collections.abc``), reports a
``KeyboardInterrupt`` raised in it as "Exception ignored" and goes on — a stopped ``serve``
trained its teachers and served until killed — and leaves Python's "unhandled interrupt" flag
set, so the process ended by SIGINT, not 130; a compiled module of scipy turned one into
"ImportError: initialization failed"; a Ray import cut short left an exit hook that failed on
the half-made module; and a child Ray forks runs Python's at-fork hooks before it blocks SIGINT.
A blocked signal stays pending and is delivered, once, when the block ends: at a line of ours.
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


def import_libraries() -> None:
    """Import Ray and torch whole, Ctrl-C held (see above): a command calls it before the first
    step that needs them, in the ``try`` that turns a ``KeyboardInterrupt`` into its one line."""
    with signals_held({signal.SIGINT}):
        import ray  # noqa: F401
        import torch  # noqa: F401
