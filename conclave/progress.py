"""A line that counts the seconds of a step that says nothing while it runs (Ray's start, actors
starting and loading their data): without it a first run looks hung for up to a minute. And the
format of the driver's bars over owners' private work (``COUNTS``): how far, never how fast."""
from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

from tqdm import tqdm

TICK_S = 1.0  # how often the line's seconds move
# A bar over owners' private work (teachers training, DP-SGD epochs, votes): its rate and times
# would tell whoever reads the driver's terminal how long an owner's records took; counts do not.
COUNTS = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit}"


@contextlib.contextmanager
def waiting(what: str, enabled: bool = True) -> Iterator[None]:
    """Show ``what: <elapsed>`` on stderr (tqdm) while the body runs, cleared when it ends; only on
    a terminal (a log or a captured stderr keeps its lines: a failure stays one line)."""
    if not enabled or not sys.stderr.isatty():
        yield
        return
    stop = threading.Event()
    with tqdm(desc=what, bar_format="{desc}: {elapsed}", leave=False) as line:

        def tick() -> None:
            while not stop.wait(TICK_S):
                line.refresh()

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
