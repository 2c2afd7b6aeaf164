"""What ends a command: one line on stderr and an exit status that says which kind of failure it was.

Every failure a command reports is a ``ConclaveError``: its message is the line, its class's
``exit_code`` the status, so scripts and job schedulers can tell the kinds apart (the statuses
of ``conclave run``: docs/main-job.md). Each layer derives its own errors from it, each with
its status (``ConfigError`` 2, ``OwnerDropout`` 3, ``BudgetExceeded`` 4, ``TrackingFailed``
6...), and ``failure`` turns whatever ended a run — a Ray error or Ctrl-C included — into its
line and status.

This module sits in the root package, under no layer, and imports nothing of the project, so
every layer may derive its errors from it.
"""
from __future__ import annotations

import sys
from typing import ClassVar


class ConclaveError(Exception):
    """A failure a command ends with, in one line (the message); ``exit_code``: its status."""

    exit_code: ClassVar[int] = 1

    def run_line(self, run: str) -> str:
        """The line that says this ended the run named ``run``."""
        return str(self)


class RunRefused(ConclaveError):
    """A ledger or an owner's node refused the run before it released anything."""

    exit_code = 2

    def run_line(self, run: str) -> str:
        return f"run '{run}' refused: {first_line(self)}"


class InvalidValue(ConclaveError, ValueError):
    """An argument, a setting or an input the code cannot take; the message names it. A
    ``ValueError`` too, so callers that catch one still do."""

    exit_code = 2

    def run_line(self, run: str) -> str:
        return f"run '{run}' failed: {first_line(self)}"


class ClusterLost(ConclaveError):
    """Ray could not run an actor or a task (a node or worker died, out of resources)."""

    exit_code = 5

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {first_line(cause)}")

    def run_line(self, run: str) -> str:
        return f"run '{run}' lost a Ray actor or task: {self}"


class Interrupted(ConclaveError):
    """Ctrl-C (or SIGTERM where a command treats it so)."""

    exit_code = 130

    def run_line(self, run: str) -> str:
        return f"run '{run}' interrupted; its results folder is as it was"


class RunFailed(ConclaveError):
    """Anything else, after the start (the traceback is in the log with -v)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {first_line(cause)}")

    def run_line(self, run: str) -> str:
        return f"run '{run}' failed: {self} (-v for the traceback)"


def failure(err: BaseException, run: str) -> tuple[int, str]:
    """(exit status, one line) for an exception that ended the run named ``run``."""
    known = as_conclave_error(err)
    return known.exit_code, known.run_line(run)


def as_conclave_error(err: BaseException) -> ConclaveError:
    """``err`` itself, or what it means to a command: Ctrl-C, a lost Ray actor or task, or a failure."""
    if isinstance(err, ConclaveError):
        return err
    if isinstance(err, KeyboardInterrupt):
        return Interrupted()
    import ray  # here: a command that never ran anything does not start Ray's import

    if isinstance(err, ray.exceptions.RayError):
        return ClusterLost(err)
    return RunFailed(err)


def fail(err: ConclaveError, prefix: str = "conclave") -> int:
    """Print ``err`` as the one line its command ends with; returns its exit status."""
    print(f"{prefix}: {err}", file=sys.stderr)
    return err.exit_code


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (at most 300 characters), or "(no message)"."""
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else "(no message)"
