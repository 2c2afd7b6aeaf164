"""Where a run leaves its evidence: ``results/<run>/`` with config, metrics and privacy JSON.

A run started from the CLI writes into a staging folder beside its results folder
(``RunDirectory.staged``) and replaces the results folder's contents only when it succeeds, so a
failed run never leaves its config beside an earlier run's metrics. What must outlive a failed
run — a durable ledger that composes across runs on the same private data — lives in the results
folder itself (``RunDirectory.durable``) and is kept.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from conclave.errors import RunRefused
from conclave.registry import import_path

log = logging.getLogger(__name__)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not np.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    if callable(value):  # a user's model factory given to the library: its import path
        return import_path(value)
    return value


DURABLE_PREFIX = "ledger.sqlite"  # the durable ledger and its WAL files: kept when a run replaces a folder
RUN_LOCK = ".run.lock"  # held by the run writing into the folder: one run per results folder at a time


class ResultsFolderInUse(RunRefused):
    """Another run is writing into the same results folder (it holds ``RUN_LOCK``)."""


def _hold_folder(folder: Path) -> IO[str]:
    """The results folder's run lock, held (``ResultsFolderInUse`` in one line if another run has
    it); ``_release_folder`` removes it. A lock whose file was removed meanwhile is taken again."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RUN_LOCK
    while True:
        lock = open(path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            lock.close()
            raise ResultsFolderInUse(f"results folder {folder} is in use by another run (pid {holder}); wait for "
                                     "it to finish or choose another --run-name") from None
        if path.exists() and os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
            break
        lock.close()  # its holder removed it as we opened it: take the new one
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def _release_folder(folder: Path, lock: IO[str]) -> None:
    (folder / RUN_LOCK).unlink(missing_ok=True)  # while still held: a later run makes a fresh one
    lock.close()


class RunDirectory:
    """One run's output folder; every file is JSON a machine can read back.

    ``path`` is where the run writes; ``durable`` is where state that outlives the run is kept
    (the same folder, unless the run is staged).
    """

    def __init__(self, root: str | Path, run_name: str, staging: bool = False) -> None:
        self.durable = Path(root) / run_name
        self.durable.mkdir(parents=True, exist_ok=True)
        self.path = Path(root) / f".{run_name}.incomplete" if staging else self.durable
        if staging:
            shutil.rmtree(self.path, ignore_errors=True)  # what a killed run left
            self.path.mkdir()

    @classmethod
    @contextlib.contextmanager
    def staged(cls, root: str | Path, run_name: str) -> Iterator[RunDirectory]:
        """A run's folder that takes the place of ``root/run_name``'s outputs only if the run
        finishes: on an exception the staging folder is removed and the results folder is as it was
        (its durable ledger keeps what the failed run was charged); one this run made and left
        empty is removed, so a refused run leaves no folder behind."""
        made = [folder for folder in (Path(root) / run_name, *(Path(root) / run_name).parents) if not folder.exists()]
        lock = _hold_folder(Path(root) / run_name)  # before the staging folder, which another run may be filling
        try:
            directory = cls(root, run_name, staging=True)
            try:
                yield directory
            except BaseException:
                shutil.rmtree(directory.path, ignore_errors=True)
                _release_folder(Path(root) / run_name, lock)
                for folder in made:  # deepest first; only while empty
                    with contextlib.suppress(OSError):
                        folder.rmdir()
                raise
            directory._publish()
        finally:
            _release_folder(Path(root) / run_name, lock)

    def _publish(self) -> None:
        for old in self.durable.iterdir():
            if not old.name.startswith(DURABLE_PREFIX) and old.name != RUN_LOCK:
                shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
        for new in self.path.iterdir():
            new.rename(self.durable / new.name)
        self.path.rmdir()
        self.path = self.durable

    def write_json(self, name: str, payload: Any) -> Path:
        target = self.path / f"{name}.json"
        target.write_text(json.dumps(_jsonable(payload), indent=2, sort_keys=True) + "\n")
        log.info("wrote %s", target)
        return target

    def plot(self, name: str, x: list[float], ys: dict[str, list[float]], xlabel: str, ylabel: str) -> Path:
        """A line plot of one or more series against ``x``, saved as PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for label, y in ys.items():
            ax.plot(x[: len(y)], y, marker="o", markersize=3, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(ys) > 1:
            ax.legend()
        target = self.path / f"{name}.png"
        fig.tight_layout()
        fig.savefig(target, dpi=120)
        plt.close(fig)
        return target
