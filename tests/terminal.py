"""Children that a test stops as a user's Ctrl-C would: started as a terminal starts a foreground
job, in a process group of their own, with SIGINT at its default action. A child inherits an
ignored SIGINT (``nohup``, a background shell, many CI runners start the suite so), and a Ctrl-C
test's child would then run to its end; the product rightly leaves an inherited SIG_IGN alone."""
from __future__ import annotations

import signal
import subprocess


def foreground(command: list[str], **popen) -> subprocess.Popen:
    """``subprocess.Popen(command, **popen)`` in a new session, with SIGINT as a terminal gives it.
    A handler installed in this process becomes the default action at the child's exec, so the
    parent's is set for the moment of the start (in the main thread, where pytest runs tests)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(command, start_new_session=True, **popen)
    finally:
        signal.signal(signal.SIGINT, previous)
