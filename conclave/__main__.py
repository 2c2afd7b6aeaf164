"""``python -m conclave`` and the ``conclave`` console script: the CLI, with Ctrl-C one line
from the first instant.

A Ctrl-C raises KeyboardInterrupt wherever it lands, and a command's first moments go to
imports (argparse, logging, the CLI's modules), where it would print a 20-30 line traceback.
Until the CLI is loaded, this module's handler ends the process with one line and status 130:
nothing has started, so nothing is left to undo. Then Python's own handler is back, and the CLI
and each command handle Ctrl-C themselves (``cluster.signal_hold``, ``serve``'s stop). Only the
console script and ``python -m conclave`` import this module.
"""
import os
import signal
import sys

INTERRUPTED = 130  # conclave.errors.Interrupted's exit status, before anything can be imported


def _interrupted(signum, frame) -> None:
    os.write(2, b"conclave: interrupted\n")
    os._exit(INTERRUPTED)


# A shell starts a background job with SIGINT ignored: that stays as it is.
EARLY = signal.getsignal(signal.SIGINT) is signal.default_int_handler
if EARLY:
    signal.signal(signal.SIGINT, _interrupted)


def main() -> int:
    from conclave.cluster import cli

    if EARLY:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
