"""A signal sent while ``signals_held`` holds it is delivered once, when the block ends: its
handler runs at the caller's line after the block, never inside it."""
from __future__ import annotations

import signal
import threading
import time

from conclave.cluster.signal_hold import signals_held


def test_a_ctrl_c_sent_meanwhile_is_handled_once_the_block_has_run_whole():
    ran: list[str] = []
    handled: list[list[str]] = []
    # Its own handler: an in-process serve earlier in the session leaves SIGINT ignored, as the CLI means to.
    previous = signal.signal(signal.SIGINT, lambda *_: handled.append(list(ran)))
    try:
        with signals_held({signal.SIGINT}):
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # to this thread: others may not block it
            time.sleep(0.05)  # where an unheld Ctrl-C is handled
            ran.append("the block")
        time.sleep(0.01)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert handled == [["the block"]]
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # the mask is as before


def test_nothing_is_delivered_when_nothing_came_and_the_mask_is_restored():
    with signals_held({signal.SIGINT, signal.SIGTERM}):
        time.sleep(0.01)
    assert not {signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, set())
