"""A real `conclave serve` as a child process, for the benchmarks that measure it from outside.

    with ServeProcess(config_dict, workdir) as serve:
        client = AggregatorClient(serve.address, token=serve.token)

It writes the config to ``workdir``, starts the CLI on a free port of 127.0.0.1 with a bearer
token in ``$CONCLAVE_TOKEN`` and ``$CONCLAVE_HOME`` in ``workdir`` (so no ledger of the user's is
touched), waits until it serves, and stops it with SIGTERM (a clean stop: teachers' files
removed, ledger closed).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServeProcess:
    def __init__(self, config: dict, workdir: Path, start_timeout: float = 900.0) -> None:
        self.config, self.workdir, self.start_timeout = config, Path(workdir), start_timeout
        self.port = free_port()
        self.token = TOKEN
        self.ledger = self.workdir / "serve-ledger.sqlite"
        self.process: subprocess.Popen | None = None
        self.start_seconds = 0.0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> ServeProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / "serve.yaml"
        config_path.write_text(yaml.safe_dump(self.config))
        env = {**os.environ, "CONCLAVE_TOKEN": self.token, "CONCLAVE_HOME": str(self.workdir / "home")}
        started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "conclave.cluster.cli", "serve", str(config_path), "--port", str(self.port),
             "--ledger", str(self.ledger)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=(self.workdir / "serve.err").open("w"), text=True)
        timer = threading.Timer(self.start_timeout, self.process.kill)
        timer.start()
        try:
            for line in self.process.stdout:
                if line.startswith("aggregator serving on"):
                    break
            else:
                raise RuntimeError(f"serve exited before serving; see {self.workdir / 'serve.err'}")
        finally:
            timer.cancel()
        threading.Thread(target=self.process.stdout.read, daemon=True).start()  # keep the pipe drained
        self.start_seconds = time.monotonic() - started
        return self

    def __exit__(self, *exc_info) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
