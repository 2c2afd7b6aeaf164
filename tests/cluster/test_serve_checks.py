"""``conclave serve`` checks what it needs before Ray starts (TLS files, port, ledger folder),
keeps a token from the environment off its output and out of Ray's processes, takes any host
that resolves to loopback only as loopback, stops cleanly on Ctrl-C at any moment of its start,
and keeps failed TLS handshakes to a few log lines."""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from conclave.actors.aggregator import ServerSettings, is_loopback
from conclave.cluster.client import AggregatorClient
from conclave.cluster.tls import CertificateError, check_server_files, create_authority, issue
from tests.certificates import make_certificates
from tests.terminal import foreground

ROOT = Path(__file__).resolve().parents[2]
SMALL = {
    "pipeline": "teacher_student",
    "name": "checked",
    "seed": 1,
    "data": {"name": "digits", "public_size": 200},
    "teachers": {"count": 2, "model": "digits_cnn", "train": {"epochs": 1, "batch_size": 32, "lr": 0.003}},
    "mechanism": {"name": "gnmax", "params": {"sigma": 2.0}},
    "privacy": {"budget": 1000.0, "delta": 1.0e-5},
    "student": {"queries": 40, "batch_size": 40, "model": "digits_cnn",
                "train": {"epochs": 1, "batch_size": 32, "lr": 0.003}},
}


def _serve(tmp_path: Path, capsys, *flags: str) -> tuple[int, list[str]]:
    """``conclave serve`` in this process; its exit status and stderr lines. Nothing may start."""
    import ray

    from conclave.cluster import serve_command
    from conclave.cluster.cli import build_parser

    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(SMALL))
    ledger = Path(flags[flags.index("--ledger") + 1]) if "--ledger" in flags else tmp_path / "l.sqlite"
    argv = ["serve", str(config), *flags] + ([] if "--ledger" in flags else ["--ledger", str(ledger)])
    was_running = ray.is_initialized()
    status = serve_command.main(build_parser("serve").parse_args(argv), threading.Event())
    assert ray.is_initialized() == was_running  # refused before Ray
    assert not ledger.exists()  # and before the ledger
    return status, capsys.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certs"))


def test_a_garbage_certificate_is_refused_in_one_line(tmp_path, capsys, certs):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    status, err = _serve(tmp_path, capsys, "--tls-cert", str(garbage), "--tls-key", str(certs.server_key))
    assert status == 2 and err == [f"conclave: server: tls_cert: {garbage} is not a PEM certificate"]


def test_the_real_cli_refuses_a_garbage_certificate_before_loading_torch_or_ray(tmp_path, certs):
    # Before: torch, Ray and the pipelines loaded first: 15-20 s on a loaded machine to read one bad file.
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(SMALL))
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "conclave", "serve", str(config), "--ledger",
                           str(tmp_path / "l.sqlite"), "--tls-cert", str(garbage), "--tls-key", str(certs.server_key)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    said = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 2 and said == [f"conclave: server: tls_cert: {garbage} is not a PEM certificate"]
    assert not {"torch", "ray", "grpc"} & imported


def test_a_key_of_another_certificate_is_refused_in_one_line(tmp_path, capsys, certs):
    other = issue(create_authority(tmp_path / "other-ca", days=1), tmp_path / "other", ("127.0.0.1",), days=1)
    status, err = _serve(tmp_path, capsys, "--tls-cert", str(certs.server_cert), "--tls-key", str(other.key))
    assert status == 2 and len(err) == 1
    assert err[0] == f"conclave: server: tls_key: {other.key} is not the private key of the certificate in " \
                     f"{certs.server_cert}"


def test_a_garbage_key_or_client_ca_is_refused_in_one_line(tmp_path, capsys, certs):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    status, err = _serve(tmp_path, capsys, "--tls-cert", str(certs.server_cert), "--tls-key", str(garbage))
    assert status == 2 and err == [f"conclave: server: tls_key: {garbage} is not a PEM private key"]
    status, err = _serve(tmp_path, capsys, "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                         "--tls-client-ca", str(garbage))
    assert status == 2 and err == [f"conclave: server: tls_client_ca: {garbage} is not a PEM certificate"]


def test_matching_files_pass_the_check(certs):
    check_server_files(certs.server_cert, certs.server_key, certs.ca)
    with pytest.raises(CertificateError, match="not the private key"):
        check_server_files(certs.server_cert, certs.client_key)


def test_an_expired_certificate_and_an_encrypted_key_are_refused(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    expired = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=3))
               .not_valid_after(now - datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    cert_path, key_path, locked_path = tmp_path / "old.pem", tmp_path / "old.key", tmp_path / "locked.key"
    cert_path.write_bytes(expired.public_bytes(serialization.Encoding.PEM))
    pkcs8 = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
    key_path.write_bytes(key.private_bytes(*pkcs8, serialization.NoEncryption()))
    locked_path.write_bytes(key.private_bytes(*pkcs8, serialization.BestAvailableEncryption(b"secret")))
    with pytest.raises(CertificateError, match=r"old.pem is valid only from .* UTC$"):
        check_server_files(cert_path, key_path)
    with pytest.raises(CertificateError, match="is encrypted"):
        check_server_files(cert_path, locked_path)


def test_a_taken_port_is_refused_in_one_line(tmp_path, capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        status, err = _serve(tmp_path, capsys, "--port", str(port))
    assert status == 2 and len(err) == 1 and f"127.0.0.1:{port}" in err[0] and "in use" in err[0]


def test_a_ledger_folder_that_cannot_be_made_is_refused_in_one_line(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    status, err = _serve(tmp_path, capsys, "--ledger", str(blocker / "ledger.sqlite"))
    assert status == 2 and len(err) == 1
    assert err[0].startswith(f"conclave: ledger {blocker / 'ledger.sqlite'}: its folder {blocker} is not writable")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1", "127.0.0.2", "localhost", "::1", "[::1]",
                                  "::ffff:127.0.0.1"])
def test_loopback_is_recognised_by_address_not_by_spelling(host):
    assert is_loopback(host)
    assert ServerSettings(host=host).host == host  # served without TLS: nobody else can connect


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "0", "192.0.2.1", "name.invalid"])
def test_other_hosts_are_not_loopback(host):
    assert not is_loopback(host)
    with pytest.raises(ValueError, match="reachable from other machines"):
        ServerSettings(host=host)


class _Serve:
    """A real ``conclave serve`` in a session of its own (Ctrl-C in a terminal reaches the whole
    foreground group: Ray's processes too), its output collected as it comes and every process
    under it recorded every 50 ms."""

    def __init__(self, tmp_path: Path, *flags: str, program: tuple[str, ...] = ("-m", "conclave.cluster.cli"),
                 env: dict[str, str] | None = None) -> None:
        config = tmp_path / "serve.yaml"
        config.write_text(yaml.safe_dump(SMALL))
        self.process = foreground(
            [sys.executable, *program, "serve", str(config), "--ledger", str(tmp_path / "l.sqlite"),
             "--port", "0", *flags],
            cwd=ROOT, env={**os.environ, "CONCLAVE_TOKEN": "t", **(env or {})}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        self.output = b""
        self.seen: dict[int, float] = {}  # pid → start time of every process under serve
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self) -> None:
        while chunk := os.read(self.process.stdout.fileno(), 65536):
            self.output += chunk

    def _watch(self) -> None:
        while self.process.poll() is None:
            try:
                for child in psutil.Process(self.process.pid).children(recursive=True):
                    self.seen.setdefault(child.pid, child.create_time())
            except psutil.Error:
                pass
            time.sleep(0.05)

    def wait_for(self, text: str, seconds: float = 300) -> None:
        deadline = time.monotonic() + seconds
        while text.encode() not in self.output:
            assert self.process.poll() is None and time.monotonic() < deadline, self.text
            time.sleep(0.02)

    def ctrl_c(self) -> int:
        os.killpg(self.process.pid, signal.SIGINT)
        return self.wait(timeout=120)

    def wait(self, timeout: float) -> int:
        """Its exit status, once its output has been read to the end: under load the reader
        thread may not yet have what it wrote last when the process ends."""
        status = self.process.wait(timeout=timeout)
        self._reader.join(timeout=30)
        return status

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace")

    def left_running(self, within: float = 15.0) -> list[int]:
        """Processes that ran under serve and still run ``within`` s after it ended."""
        deadline = time.monotonic() + within
        while True:
            left = []
            for pid, started in self.seen.items():
                try:
                    process = psutil.Process(pid)
                    if abs(process.create_time() - started) < 0.01 and process.status() != psutil.STATUS_ZOMBIE:
                        left.append(pid)
                except psutil.Error:
                    continue
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


@pytest.mark.parametrize("moment", ["loading", "Ray starting", "training teachers"])
def test_ctrl_c_at_any_moment_of_the_start_stops_everything_without_a_traceback(tmp_path, moment):
    """Before: a traceback, and two Ray agents left for minutes."""
    serve = _Serve(tmp_path)
    try:
        if moment == "loading":
            time.sleep(1.0)  # the libraries load, Ctrl-C held until they have (Ray's import swallowed it)
        elif moment == "Ray starting":  # its first process is up, the rest are coming
            serve.wait_for("starting embedded Ray")
            deadline = time.monotonic() + 60
            while not serve.seen and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            serve.wait_for(moment)
        status = serve.ctrl_c()
    finally:
        if serve.process.poll() is None:
            os.killpg(serve.process.pid, signal.SIGKILL)
    assert status == 130, serve.text
    assert "Traceback" not in serve.text and "interrupted while starting" in serve.text, serve.text
    assert "aggregator serving on" not in serve.text
    assert not serve.left_running(), (serve.seen, serve.text)
    assert moment == "loading" or serve.seen  # Ray had started processes, and they are gone


@pytest.mark.parametrize("marker", ["conclave.cluster", "argparse", "conclave.cluster.config"])
def test_ctrl_c_in_the_first_instants_is_one_line(tmp_path, marker):
    """Before: a 20-30 line traceback from an import (importlib.metadata, argparse) in the first
    0.15-0.5 s. ``-X importtime`` says when each import has ended: the signal lands right after
    ``marker``'s: the CLI package's first import, the CLI's own, the command's (under the hold)."""
    serve = _Serve(tmp_path, program=("-X", "importtime", "-m", "conclave"))
    try:
        deadline = time.monotonic() + 60
        while not re.search(rf"\|\s+{re.escape(marker)}\n", serve.text):
            assert serve.process.poll() is None and time.monotonic() < deadline, serve.text
            time.sleep(0.001)
        status = serve.ctrl_c()
    finally:
        if serve.process.poll() is None:
            os.killpg(serve.process.pid, signal.SIGKILL)
    said = [line for line in serve.text.splitlines() if not line.startswith("import time:")]
    # Past the command's import the start's own hold may have the signal: its line says so.
    assert status == 130 and len(said) == 1 and said[0] in (
        "conclave: interrupted", "conclave: interrupted while starting; stopping what was started (nothing was served)"
    ), serve.text


# ``conclave serve`` whose start meets a Ctrl-C that a library swallows, as Ray's compiled module
# did with one raised while it imported ("Exception ignored"): before, the start went on and served.
SWALLOWING = """
import os, signal, sys, time
from conclave.cluster import cli
from conclave.cluster.teaching import ensemble

checked_public = ensemble.checked_public

def swallowing(config):
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
    except KeyboardInterrupt:
        print("swallowed", flush=True)
    return checked_public(config)

ensemble.checked_public = swallowing
sys.exit(cli.main())
"""


def test_a_ctrl_c_a_library_swallows_still_stops_the_start(tmp_path):
    """Swallowed while the public data loads, it stops the start at the end of that step:
    before Ray starts, not once the teachers have trained."""
    serve = _Serve(tmp_path, program=("-c", SWALLOWING))
    try:
        status = serve.wait(timeout=240)
    finally:
        if serve.process.poll() is None:
            os.killpg(serve.process.pid, signal.SIGKILL)
    assert status == 130 and "swallowed" in serve.text, serve.text
    assert "Traceback" not in serve.text and "interrupted while starting" in serve.text, serve.text
    assert "aggregator serving on" not in serve.text and "starting embedded Ray" not in serve.text
    assert not serve.left_running(), (serve.seen, serve.text)


def test_a_tls_service_keeps_an_environment_token_from_output_and_ray_and_logs_few_failed_handshakes(tmp_path, certs):
    """One real ``conclave serve`` with its embedded Ray, serving TLS with a token from the
    environment (one process for these checks: suite time). Its output, and the environment of
    every process under it, while it serves; then 300 plaintext connections to the TLS port:
    before, 300 lines of gRPC's in 0.1 s; a client with the CA is answered meanwhile, and Ctrl-C
    then stops everything."""
    token = "env-token-that-must-not-leak-4242"
    serve = _Serve(tmp_path, "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                   env={"CONCLAVE_TOKEN": token, "CONCLAVE_TEST_INHERITED": "1"})
    try:
        serve.wait_for("press Ctrl-C")
        # Ray's processes, the teachers' workers among them (the driver holds the token; its /proc
        # environ is the one it started with).
        environments = {}
        for process in psutil.Process(serve.process.pid).children(recursive=True):
            try:
                environments[" ".join(process.cmdline())] = process.environ()
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
        teachers = [environment for command, environment in environments.items() if "TeacherGroup" in command]
        assert teachers and all("CONCLAVE_TEST_INHERITED" in environment for environment in teachers)  # inherited
        assert not [command for command, environment in environments.items() if "CONCLAVE_TOKEN" in environment]
        address = re.search(rb"aggregator serving on (\S+)", serve.output).group(1).decode()
        host, port = address.rsplit(":", 1)
        for _ in range(300):
            with socket.create_connection((host, int(port)), timeout=5) as connection:
                connection.sendall(b"GET / HTTP/1.1\r\n\r\n")
                with contextlib.suppress(OSError):
                    connection.recv(64)
        with AggregatorClient(address, token=token, root_cert=certs.ca) as client:
            assert client.budget()["queries_answered"] == 0  # TLS clients are served meanwhile
        time.sleep(0.5)
        status = serve.ctrl_c()
    finally:
        if serve.process.poll() is None:
            os.killpg(serve.process.pid, signal.SIGKILL)
    assert "token: from $CONCLAVE_TOKEN" in serve.text and token not in serve.text, serve.text
    failed = [line for line in serve.text.splitlines() if "andshake" in line]
    assert 1 <= len(failed) <= 2 and "TLS handshake failed" in failed[0], failed[:5]
    assert status == 0 and "stopped; realised spend" in serve.text and "Traceback" not in serve.text, serve.text
    assert not serve.left_running(), (serve.seen, serve.text)


class _Printed:
    """Standard output that another thread may read while the service prints (pytest's capture
    can lose a line written while it is read)."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        return "".join(list(self.parts))


def test_sigterm_stops_the_service_as_cleanly_as_ctrl_c(ray_session, tmp_path, monkeypatch):
    """A service manager's stop: a real SIGTERM to a ``conclave serve`` that runs in this process's
    main thread (where it installs its handlers), on the session's Ray."""
    from conclave.cluster import serve_command
    from conclave.cluster.cli import build_parser

    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(SMALL))
    args = build_parser("serve").parse_args(["serve", str(config), "--ledger", str(tmp_path / "l.sqlite"),
                                             "--port", "0"])
    printed, sent = _Printed(), threading.Event()
    monkeypatch.setattr(sys, "stdout", printed)

    def stop_once_serving() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if "press Ctrl-C" in printed.text:
                os.kill(os.getpid(), signal.SIGTERM)
                sent.set()
                return
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # never served: end the start (the test fails below)

    stopper = threading.Thread(target=stop_once_serving, daemon=True)
    stopper.start()
    status = serve_command.main(args)
    stopper.join(10)
    assert sent.is_set() and status == 0 and "stopped; realised spend" in printed.text, printed.text
