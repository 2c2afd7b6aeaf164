"""A ledger's one writer: an exclusive ``flock`` on ``<ledger>.lock``, held while it is open.

Two writers would each check the budget against what they alone had charged, so a second opener,
in any process, is refused at once (``LedgerInUse``); the OS drops the lock when its holder dies.
"""
from __future__ import annotations

import fcntl
import os
import weakref
from pathlib import Path
from typing import IO

from conclave.errors import RunRefused


class LedgerInUse(RunRefused, RuntimeError):
    """Another writer holds the ledger's lock: a ledger has one writer at a time."""


_HELD_LOCKS: weakref.WeakSet[IO[str]] = weakref.WeakSet()  # the writer locks this process holds


def _drop_inherited_locks() -> None:
    """In a forked child: close its copies of the parent's lock files. A flock belongs to the
    open file, which a fork shares: a child outliving its parent would hold the ledger."""
    for handle in list(_HELD_LOCKS):
        handle.close()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def hold_lock(path: Path) -> IO[str]:
    """The writer's lock: an exclusive flock on ``<ledger>.lock``, held while the returned file
    is open (the OS drops it when the process dies). The file is never deleted: a writer that
    opened it before a deletion would hold a lock nobody else sees."""
    lock_path = path.with_name(path.name + ".lock")
    handle = open(lock_path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip()
        handle.close()
        pid = f" (pid {holder})" if holder.isdigit() else ""
        raise LedgerInUse(f"ledger {path} is in use: another process{pid} holds its lock {lock_path}; "
                          "a ledger has one writer at a time") from None
    except BaseException:
        handle.close()
        raise
    handle.truncate(0)  # the holder's pid, for the line a second opener prints
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    _HELD_LOCKS.add(handle)
    return handle
