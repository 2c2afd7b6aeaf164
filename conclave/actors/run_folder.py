"""Private folders on a node for what a run makes from private data (the teachers' checkpoints),
which must not outlive the run.

A run's folder is ``<node temp dir>/conclave-private-<uid>/<run id>``: 0700, inside a 0700
folder this user owns. Every process working in it (``claim``) leaves a marker naming itself
(run id, host, PID and the PID's start time); the last to ``release`` it removes the folder.
A run that was killed leaves its folder with markers of processes that are gone: the next
``claim`` on the node removes every folder whose markers all name dead processes of this
host. A folder without a marker, or with one of a live process or of another host, is left.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import psutil
from conclave.errors import InvalidValue

_MARKER = ".owner-{pid}.json"
_MARKERS = ".owner-*.json"
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def base_folder() -> Path:
    """Where this user's run folders live on this node (not created here)."""
    return Path(tempfile.gettempdir()) / f"conclave-private-{os.getuid()}"


def claim(run: str) -> Path:
    """The private folder of ``run`` on this node, created if need be, with this process's
    marker in it; first removes what killed runs left here. ``OSError`` (one line) if the
    folder, or the one holding it, is not this user's alone."""
    if not _RUN_ID.fullmatch(run):
        raise InvalidValue(f"run id must be 1-64 letters, digits, '-' or '_', got {run!r}")
    base = _private_directory(base_folder())
    reclaim(base, keep=run)
    folder = _private_directory(base / run)
    for marker in folder.glob(_MARKERS):  # a restarted process's predecessor: gone, its marker with it
        if _dead(marker):
            marker.unlink(missing_ok=True)
    me = psutil.Process()
    identity = {"run": run, "host": socket.gethostname(), "pid": me.pid, "create_time": me.create_time()}
    marker = folder / _MARKER.format(pid=me.pid)
    partial = marker.with_suffix(".partial")
    partial.write_text(json.dumps(identity))
    partial.replace(marker)  # a reader sees a whole marker or none
    return folder


def release(folder: Path) -> None:
    """This process is done with ``folder``: its marker goes, and the folder with everything
    in it when no other process of the run holds it."""
    folder = Path(folder)
    (folder / _MARKER.format(pid=os.getpid())).unlink(missing_ok=True)
    if folder.is_dir() and not any(folder.glob(_MARKERS)):
        shutil.rmtree(folder, ignore_errors=True)  # another last holder may be removing it too


def reclaim(base: Path | None = None, keep: str | None = None) -> list[Path]:
    """Remove the run folders under ``base`` (default: ``base_folder()``) whose markers all name
    processes of this host that are gone, except run ``keep``; returns what was removed."""
    base = base_folder() if base is None else Path(base)
    removed = []
    for folder in sorted(base.iterdir()) if base.is_dir() else ():
        if folder.name == keep or folder.is_symlink() or not folder.is_dir():
            continue
        markers = list(folder.glob(_MARKERS))
        if markers and all(_dead(marker) for marker in markers):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _dead(marker: Path) -> bool:
    """Whether ``marker`` names a process of this host that no longer runs (its PID gone, a
    zombie, or reused by a process started later). Unreadable or foreign: not known dead."""
    try:
        identity = json.loads(marker.read_text())
        if identity["host"] != socket.gethostname():
            return False
        process = psutil.Process(int(identity["pid"]))
        return (abs(process.create_time() - float(identity["create_time"])) >= 0.01
                or process.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True
    except (OSError, ValueError, KeyError, TypeError, psutil.AccessDenied):
        return False


def _private_directory(path: Path) -> Path:
    """``path`` as a directory of this user's, 0700 (tightened if it was looser)."""
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise OSError(f"{path} is not a directory of this user's: private models cannot be kept there")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)
    return path
