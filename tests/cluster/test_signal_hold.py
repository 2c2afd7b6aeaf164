"""A signal sent while ``signals_held`` holds it is delivered once, when the block ends: the
``KeyboardInterrupt`` is raised at the caller's line after the block, never inside it."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from conclave.cluster.signal_hold import signals_held


def test_a_ctrl_c_sent_meanwhile_is_raised_once_the_block_has_run_whole():
    ran: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with signals_held({signal.SIGINT}):
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # to this thread: others may not block it
            time.sleep(0.05)  # where an unheld Ctrl-C is raised
            ran.append("the block")
        ran.append("after the block")
    assert ran == ["the block"]
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # the mask is as before


def test_nothing_held_back_is_raised_when_nothing_came():
    with signals_held({signal.SIGINT, signal.SIGTERM}):
        time.sleep(0.01)
    assert not {signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, set())
