"""The Ctrl-C tests' children start with SIGINT at its default action even when the suite was
started with SIGINT ignored, and the suite's own disposition is left as it was."""
from __future__ import annotations

import signal
import subprocess
import sys

from tests.terminal import foreground


def test_a_foreground_child_meets_sigint_at_its_default_whatever_the_suite_inherited():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under nohup or a background shell
    try:
        child = foreground([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT))"],
                           stdout=subprocess.PIPE, text=True)
        printed, _ = child.communicate(timeout=60)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert printed.strip() == "<built-in function default_int_handler>"  # Python's own: SIGINT was SIG_DFL
