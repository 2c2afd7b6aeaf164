"""``conclave serve CONFIG``: train the teachers and serve the aggregator to outside students.

Noise from OS entropy only (a served answer is always a release); a durable ledger whose budget a
restart cannot change; a bearer token kept out of Ray's environment. Everything that can fail —
the TLS files, the port, the ledger — is checked before Ray starts, in one line with exit status
2; a non-loopback host without TLS is refused unless ``--allow-plaintext``.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import signal
import sqlite3
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator

from conclave.cluster.config import ConfigError, load_yaml
from conclave.cluster.signal_hold import signals_held
from conclave.errors import ConclaveError, Interrupted, fail

log = logging.getLogger(__name__)

TOKEN_ENV = "CONCLAVE_TOKEN"
STOPS = (signal.SIGTERM, signal.SIGINT)  # a service manager's stop, and Ctrl-C


class StartRefused(ConclaveError):
    """A problem found while starting the service (its settings, files, port, ledger, an owner's
    node): nothing was served, and what was started is undone."""

    exit_code = 2


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("config", help="teacher_student YAML config (see configs/)")
    parser.add_argument("--address", default=None, help="join this Ray cluster (default: start one locally)")
    parser.add_argument("--host", default=None, help="interface to listen on (default: the config's, 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default: the config's; 0 = any free port)")
    parser.add_argument("--ledger", default=None,
                        help="privacy ledger file, kept across restarts (default: results/<name>/serve-ledger.sqlite)")
    parser.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS (with --tls-key)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", default=None,
                        help="PEM CA: require client certificates it signed (mutual TLS)")
    parser.add_argument("--allow-plaintext", action="store_true", default=None,
                        help="serve a non-loopback host without TLS (only on a network you trust)")


def main(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """Serve until stopped; 2 on a problem found while starting (one line), 130 when interrupted
    while starting. Ctrl-C or SIGTERM at any moment of the start — loading, Ray starting, teachers
    training — stops what was started (actors, ledger, Ray and every process it left) and exits
    with one line, no traceback: a start can take minutes, and an operator stops it at will."""
    started = contextlib.ExitStack()  # how to undo each step of the start that has run
    # A Ray that runs already is an in-process caller's (tests): theirs to stop, not ours.
    ours = not ("ray" in sys.modules and sys.modules["ray"].is_initialized())
    try:
        with _interrupting_on_sigterm() as interrupts:
            return _serve(args, stop, started, ours, interrupts)
    except KeyboardInterrupt:
        _ignore_signals()
        print("conclave: interrupted while starting; stopping what was started (nothing was served)",
              file=sys.stderr, flush=True)
        _undo(started, ours)
        return Interrupted.exit_code


def _serve(args: argparse.Namespace, stop: threading.Event | None, started: contextlib.ExitStack, ours: bool,
           interrupts: _StartInterrupts) -> int:
    # The libraries load whole: a Ctrl-C meanwhile acts once they have (``cluster.signal_hold``).
    # The config and its TLS files first (neither torch nor Ray): a bad file is told in a second,
    # not after the heavy imports (15-20 s on a loaded machine).
    with signals_held(STOPS):
        from conclave.cluster.pipelines import load_pipeline
        from conclave.cluster.tls import HandshakeLog, check_server_files

    overrides = {"host": args.host, "port": args.port, "tls_cert": args.tls_cert, "tls_key": args.tls_key,
                 "tls_client_ca": args.tls_client_ca, "allow_plaintext": args.allow_plaintext}
    try:
        service = load_pipeline(load_yaml(args.config)).service(**overrides)
    except ConfigError as err:
        return fail(err)

    # Out of the environment before Ray starts: an embedded Ray's processes, and every worker
    # they start, inherit this process's environment. The server runs here, in the driver.
    from_env = os.environ.pop(TOKEN_ENV, None)
    token = from_env or secrets.token_urlsafe(24)
    fields = service.fields()
    try:
        if fields["tls_cert"] and fields["tls_key"]:
            check_server_files(Path(fields["tls_cert"]), Path(fields["tls_key"]),
                               None if fields["tls_client_ca"] is None else Path(fields["tls_client_ca"]))
    except ValueError as err:  # CertificateError too
        return fail(StartRefused(f"server: {err}"))
    with signals_held(STOPS):
        import torch  # noqa: F401 - loaded here rather than by the first model built, later in the start

        from conclave.cluster.ray_runtime import record_ray_processes
        from conclave.privacy.accounting.ledger import LedgerInUse
    try:
        settings = service.settings(token)  # the rest of the server's fields
    except ValueError as err:
        return fail(StartRefused(f"server: {err}"))
    try:
        public = service.public_data()
    except ConfigError as err:
        return fail(err)
    # A stop a library swallowed while the data loaded acts here, before Ray starts, not once the
    # teachers have trained (minutes later); so again once the teachers have trained.
    interrupts.raise_if_any()
    config = service.config
    ledger_path = Path(args.ledger or Path("results") / config.name / "serve-ledger.sqlite")
    try:
        service.check_port()
        _check_writable(ledger_path)
        ledger = service.open_ledger(ledger_path)
    except (ValueError, OSError, LedgerInUse) as err:  # another budget, damaged, held by another serve; the port
        return fail(StartRefused(str(err).splitlines()[0]))
    except sqlite3.Error as err:  # not a database, or one SQLite cannot write
        return fail(StartRefused(f"ledger {ledger_path}: {str(err).splitlines()[0]}"))
    started.callback(lambda: ledger.close())  # the ledger in use when the owners' wrap it
    try:  # with owners, each owner's gateway admits the service, and can pay one round, before its teachers train
        teachers = service.train(public, args.address)
    except ConclaveError as err:  # an owner refused; its data; no node can take them
        _undo(started, ours)
        return fail(err)
    started.callback(teachers.shutdown)
    interrupts.raise_if_any()  # one a library swallowed on the way: the start stops before anything is served
    # gRPC's own line for each failed TLS handshake, at most one per 10 s (a scan of the port
    # made 300 lines in 0.1 s): from here on this process's stderr goes through a filter.
    handshakes = HandshakeLog(logging.getLogger("conclave.cluster.tls")) if settings.tls else None
    if handshakes is not None:
        handshakes.start()
        started.callback(handshakes.stop)
    try:  # the gRPC server: the library's serve
        aggregator = service.serve(teachers, ledger, token)
    except (ConclaveError, ValueError, OSError) as err:  # the ledger refused; the port was taken meanwhile
        _undo(started, ours)
        return fail(StartRefused(str(err)))
    ledger = aggregator.ledger
    started.callback(aggregator.stop)
    record_ray_processes()  # the workers and agents running now, for cleanup should we be killed
    guarantee, report = aggregator.server.guarantee(), ledger.report()
    security = "mutual TLS" if settings.tls_client_ca else "TLS" if settings.tls else "plaintext"
    voters = service.voters(teachers)
    stop = stop or threading.Event()
    _stop_on_signals(stop)  # from here a signal stops the service as below, not the start
    print(f"aggregator serving on {aggregator.address} ({security}; {config.mechanism.name}, {voters}, "
          f"aggregation {config.aggregation})")
    print(f"token: from ${TOKEN_ENV}" if from_env else f"token: {token}  (generated; shown only now)")
    print(f"privacy ledger: {ledger_path}; guarantee ε = {guarantee.epsilon:.4g} at δ = {guarantee.delta:g} "
          f"({guarantee.basis}); realised spend so far ε = {report.epsilon_spent:.4g}")
    print("press Ctrl-C (or send SIGTERM) to stop", flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        aggregator.stop()  # first: no call is answered while the rest stops
        report = ledger.report()
        _undo(started, ours)  # the filter, the teachers, the ledger; Ray
        print(f"stopped; realised spend ε = {report.epsilon_spent:.4g} at δ = {report.delta:g} "
              f"(guarantee ε = {guarantee.epsilon:.4g})")
    return 0


class _StartInterrupts:
    """The start's handler of Ctrl-C and SIGTERM: ``KeyboardInterrupt`` where the start is, and
    a record of it, so that one a library swallowed (``cluster.signal_hold``) still stops it."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: object) -> None:
        self.received = True
        raise KeyboardInterrupt

    def raise_if_any(self) -> None:
        if self.received:
            raise KeyboardInterrupt


@contextlib.contextmanager
def _interrupting_on_sigterm() -> Iterator[_StartInterrupts]:
    """While starting, SIGTERM (a service manager's stop) interrupts as Ctrl-C does: both raise
    ``KeyboardInterrupt`` wherever the start is, and ``main`` undoes it. Main thread only."""
    interrupts = _StartInterrupts()
    if threading.current_thread() is not threading.main_thread():
        yield interrupts
        return
    # SIGINT too where it came ignored (a background job of a script): a stop is a stop.
    previous = {signum: signal.signal(signum, interrupts) for signum in STOPS}
    try:
        yield interrupts
    finally:
        for signum, handler in previous.items():
            if signal.getsignal(signum) is interrupts:  # not replaced since: the start failed
                signal.signal(signum, handler)


def _ignore_signals() -> None:
    """Let nothing interrupt the clean-up (it is bounded: actors, ledger, Ray's processes)."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOPS:
            signal.signal(signum, signal.SIG_IGN)


def _undo(started: contextlib.ExitStack, ours: bool) -> None:
    """Undo the start's steps, latest first, and stop Ray if this command started or joined it:
    every step is tried, and a step that fails is one log line (no traceback on the way out)."""
    _ignore_signals()  # a second Ctrl-C must not cut the clean-up short
    try:
        started.close()
    except Exception as err:  # e.g. the actors' node went down meanwhile
        log.warning("stopping the service: %s: %s", type(err).__name__, str(err).splitlines()[0] if str(err) else "")
    if ours and "ray" in sys.modules:  # not imported: nothing of Ray ran (its import is never cut short)
        from conclave.cluster.ray_runtime import stop_ray

        stop_ray()


def _stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM (a service manager's stop) and SIGINT end the service cleanly — teachers' files
    removed, ledger closed — even where SIGINT came ignored (a background job of a script)."""
    if threading.current_thread() is not threading.main_thread():
        return  # in-process callers (tests) stop it through ``stop``
    for signum in STOPS:
        signal.signal(signum, lambda *_: stop.set())


def _check_writable(ledger: Path) -> None:
    """``OSError`` (one line) unless the ledger's folder exists (made if need be) and takes
    new files, and an existing ledger file may be written: found now, not at the first charge."""
    try:
        ledger.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=ledger.parent):  # what SQLite's journal needs; also on a read-only mount
            pass
    except OSError as err:
        raise OSError(f"ledger {ledger}: its folder {ledger.parent} is not writable ({err.strerror})") from None
    if ledger.exists() and not os.access(ledger, os.R_OK | os.W_OK):
        raise OSError(f"ledger {ledger}: the file is not readable and writable by this user")
