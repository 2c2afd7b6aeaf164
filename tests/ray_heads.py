"""A Ray head a test starts (`ray start --head --block`, in its own process group) and stops: by
signalling that group only (`ray stop` would stop every Ray on the machine), then its temp dir."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def running_head(command: list[str], env: dict[str, str], log: Path, temp_dir: Path,
                 cwd: Path | None = None) -> Iterator[subprocess.Popen]:
    """``command`` started with its output in ``log``, yielded once Ray says it runs (180 s at most)."""
    with open(log, "w") as out:
        head = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        yield head
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)  # whatever is left of the group the test made
        head.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)
