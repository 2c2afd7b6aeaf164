"""What a failed label call tells its client: one meaning per status code (docs/aggregator-api.md).

RESOURCE_EXHAUSTED with ``conclave-reason: privacy-budget`` is the budget alone; a full disk or
an unwritable ledger record is UNAVAILABLE, nothing charged: the operator frees space or mends
the folder and the same call succeeds.
"""
from __future__ import annotations

import errno
import sqlite3

from conclave.privacy.accounting.ledger import LedgerUnwritable

STORAGE_FULL = ("the aggregator cannot write its privacy ledger (disk full): nothing was released or charged; "
                "retry later")
RECORD_UNWRITABLE = ("the aggregator cannot write its privacy ledger's record (see its log): nothing was released or "
                     "charged; retry later")


def storage_refusal(err: BaseException) -> str | None:
    """What the client is told when ``err`` is the ledger's storage failing (a full disk, an
    unwritable record): the ledger refuses a charge it cannot write before committing it
    (``ledger_store``), so nothing was released or charged. None for any other error."""
    if storage_full(err):
        return STORAGE_FULL
    if isinstance(err, LedgerUnwritable):
        return RECORD_UNWRITABLE
    return None


def storage_full(err: BaseException) -> bool:
    """Whether ``err``, or an error it came from, is a full disk (or quota): SQLite's
    SQLITE_FULL, or ENOSPC / EDQUOT from the OS — also inside a Ray task's error."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [err]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, sqlite3.Error) and getattr(current, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return True
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        pending += [getattr(current, "cause", None), current.__cause__, current.__context__]
    return False

