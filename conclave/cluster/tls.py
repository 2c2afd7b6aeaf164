"""Certificates for encrypted links between sites: a cluster's own CA, and a certificate and
key per node that it signs, as PEM files.

Ray encrypts and mutually authenticates its gRPC channels (driver, head, owners' nodes, their
workers) when every Ray process runs with ``RAY_USE_TLS=1`` and ``RAY_TLS_SERVER_CERT``,
``RAY_TLS_SERVER_KEY``, ``RAY_TLS_CA_CERT`` (Ray 2.60, ``ray._common.tls_utils``). Each process
presents its node's certificate both as a server and as a client, and accepts only peers whose
certificate the CA signed; a client also checks the server's certificate names the address it
dialled, so a node's certificate names the IP addresses (or DNS names) other nodes reach it
by. ``conclave ray-certs`` writes these files; the aggregator's gRPC TLS tests use the same
functions for their server and client certificates.

``HandshakeLog`` keeps a TLS port's failed handshakes to one log line per interval: gRPC writes
one line for each, and anyone who can reach the port can make thousands.
"""
from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import re
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from conclave.errors import ConclaveError

CA_CERT, CA_KEY = "ca.pem", "ca.key"
LOOPBACK_NAMES = ("127.0.0.1", "localhost")  # a node's own processes also dial each other on loopback


class CertificateError(ConclaveError, ValueError):
    """Certificates that cannot be made from what was given (one line, naming the problem)."""

    exit_code = 2


@dataclass(frozen=True)
class Authority:
    """A CA: its certificate (what every node trusts) and its private key (what signs nodes)."""
    certificate: Path
    key: Path


@dataclass(frozen=True)
class NodeCertificate:
    """What one node needs: the CA's certificate, and its own certificate and private key."""
    ca: Path
    certificate: Path
    key: Path

    def ray_env(self) -> dict[str, str]:
        """Ray's TLS settings for every Ray process of this node (absolute paths: workers may
        run in another directory)."""
        return {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": str(self.certificate.resolve()),
                "RAY_TLS_SERVER_KEY": str(self.key.resolve()), "RAY_TLS_CA_CERT": str(self.ca.resolve())}


def create_authority(directory: Path, name: str = "conclave cluster CA", days: int = 365) -> Authority:
    """A new CA in ``directory`` (``ca.pem``, ``ca.key``); refuses to replace one, since the nodes
    it signed would no longer be trusted."""
    _check_days(days)
    directory = _private_directory(directory)
    if (directory / CA_KEY).exists():
        raise CertificateError(f"{directory / CA_KEY} exists: a new CA would orphan the nodes it signed "
                               "(issue node certificates from it with --ca)")
    key = _new_key()
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = _name(name)
    certificate = (_builder(subject, subject, key, now, days)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(_key_usage(signs_certificates=True), critical=True)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()),
                                  critical=False)
                   .sign(key, hashes.SHA256()))
    return Authority(_write_certificate(certificate, directory / CA_CERT), _write_key(key, directory / CA_KEY))


def load_authority(directory: Path) -> Authority:
    """The CA ``create_authority`` wrote in ``directory``."""
    authority = Authority(Path(directory) / CA_CERT, Path(directory) / CA_KEY)
    for path in (authority.certificate, authority.key):
        if not path.is_file():
            raise CertificateError(f"{path}: no such file (create the CA first: conclave ray-certs DIR)")
    return authority


def issue(authority: Authority, directory: Path, hosts: tuple[str, ...], name: str = "node",
          days: int = 365, common_name: str | None = None) -> NodeCertificate:
    """``directory/{name}.pem`` and ``{name}.key``, signed by ``authority``, for ``hosts`` (IP
    addresses or DNS names; none: a client-only certificate), and a copy of the CA's certificate
    as ``directory/ca.pem``. Usable as server and as client, as Ray's mutual TLS needs.
    ``common_name``: the subject's (default: the first host, else ``name``); an owner's gateway
    certificate names the owner, whose identity its signatures carry (``cluster.gateway.identity``)."""
    _check_days(days)
    names = [subject_alternative_name(host) for host in hosts]
    directory = _private_directory(directory)
    issuer = x509.load_pem_x509_certificate(authority.certificate.read_bytes())
    issuer_key = serialization.load_pem_private_key(authority.key.read_bytes(), password=None)
    key = _new_key()
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (_builder(_name(common_name or (hosts[0] if hosts else name)), issuer.subject, key, now, days)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(_key_usage(signs_certificates=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                     ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                              critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    ca = directory / CA_CERT
    if ca.resolve() != authority.certificate.resolve():
        shutil.copyfile(authority.certificate, ca)
    return NodeCertificate(ca, _write_certificate(builder.sign(issuer_key, hashes.SHA256()), directory / f"{name}.pem"),
                           _write_key(key, directory / f"{name}.key"))


def subject_alternative_name(host: str) -> x509.GeneralName:
    """``host`` as a certificate names it: an IP address, else a DNS name."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise CertificateError(f"not an IP address or a host name: {host!r}")
    return x509.DNSName(host)


_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")  # RFC 1123 labels


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _check_days(days: int) -> None:
    if days < 1:
        raise CertificateError(f"days must be at least 1, got {days}")


def _builder(subject: x509.Name, issuer: x509.Name, key, now: datetime.datetime, days: int) -> x509.CertificateBuilder:
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate clocks a little behind
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))


def _key_usage(signs_certificates: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=not signs_certificates, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         key_cert_sign=signs_certificates, crl_sign=signs_certificates,
                         encipher_only=False, decipher_only=False)


def _private_directory(directory: Path) -> Path:
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory


def _write_certificate(certificate: x509.Certificate, path: Path) -> Path:
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return path


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    """The key, readable by its owner only from the moment it exists."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    return path


def check_server_files(certificate: Path, key: Path, client_ca: Path | None = None) -> None:
    """``CertificateError`` (one line) unless ``certificate`` is a PEM certificate (chain, the
    server's first) in its validity period, ``key`` the PEM private key of it, and
    ``client_ca`` PEM certificates: what a TLS server would otherwise find out only when it
    starts, after everything else."""
    chain = _pem_certificates(Path(certificate), "tls_cert")
    try:
        private = serialization.load_pem_private_key(Path(key).read_bytes(), password=None)
    except OSError as err:
        raise CertificateError(f"tls_key: cannot read {key}: {err.strerror}") from None
    except TypeError:  # encrypted: the server has no way to ask for its password
        raise CertificateError(f"tls_key: {key} is encrypted; give the server an unencrypted key") from None
    except (ValueError, UnsupportedAlgorithm):
        raise CertificateError(f"tls_key: {key} is not a PEM private key") from None
    if _public_der(private.public_key()) != _public_der(chain[0].public_key()):
        raise CertificateError(f"tls_key: {key} is not the private key of the certificate in {certificate}")
    now = datetime.datetime.now(datetime.timezone.utc)
    if not chain[0].not_valid_before_utc <= now <= chain[0].not_valid_after_utc:
        valid = chain[0].not_valid_before_utc, chain[0].not_valid_after_utc
        raise CertificateError(f"tls_cert: {certificate} is valid only from {valid[0]:%Y-%m-%d %H:%M} "
                               f"to {valid[1]:%Y-%m-%d %H:%M} UTC")
    if client_ca is not None:
        _pem_certificates(Path(client_ca), "tls_client_ca")


def _pem_certificates(path: Path, setting: str) -> list[x509.Certificate]:
    try:
        certificates = x509.load_pem_x509_certificates(path.read_bytes())
    except OSError as err:
        raise CertificateError(f"{setting}: cannot read {path}: {err.strerror}") from None
    except ValueError:  # no PEM certificate in it, or a damaged one
        raise CertificateError(f"{setting}: {path} is not a PEM certificate") from None
    return certificates


def _public_der(key) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


# gRPC's C core writes a line of its own to stderr for every failed TLS handshake (a plaintext
# client, a scanner, a certificate the server does not trust), outside Python's logging, e.g.
# ``I1127 04:30:17.905047    7072 ssl_transport_security.cc:2563] Handshake failed with error …``.
GRPC_HANDSHAKE_FAILED = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+\] Handshak(?:e|ing) failed(?P<detail>.*)$")


class HandshakeLog:
    """Rate-limited lines for failed TLS handshakes: while started, this process's stderr (fd 2)
    goes through a pipe that a thread reads; gRPC's handshake-failure lines become one warning
    per ``interval`` seconds with the count of those left out (a scan of the port made 300 lines
    in 0.1 s), and every other line passes through unchanged, in order.

    The warnings go straight to the original stderr (never through the pipe: the thread would
    wait on itself), formatted as the root logger's first handler formats.
    """

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._logger = logging.getLogger(f"{logger.name}.handshakes")
        self._interval = interval
        self._stderr: int | None = None  # the original fd 2, while started
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        from conclave.actors.labeller import RateLimitedLog

        sys.stderr.flush()
        self._stderr = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        handler = logging.StreamHandler(os.fdopen(os.dup(self._stderr), "w", buffering=1))
        root = logging.getLogger().handlers
        if root and root[0].formatter is not None:
            handler.setFormatter(root[0].formatter)
        self._logger.addHandler(handler)
        self._logger.propagate = False
        self._limited = RateLimitedLog(self._logger, self._interval)
        self._thread = threading.Thread(target=self._pump, args=(read,), name="stderr-handshakes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Give fd 2 back (the pipe's last writer closes: the thread forwards what is left and ends)."""
        if self._stderr is None:
            return
        sys.stderr.flush()
        os.dup2(self._stderr, 2)
        self._thread.join(timeout=5)
        if self._thread.is_alive():  # a child still holds the pipe: the thread forwards for as long
            return
        for handler in self._logger.handlers[:]:
            self._logger.removeHandler(handler)
            handler.close()
        os.close(self._stderr)
        self._stderr = None

    def _pump(self, read: int) -> None:
        pending = b""
        try:
            while chunk := os.read(read, 65536):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._line(line + b"\n")
            if pending:
                self._line(pending)
        finally:
            os.close(read)

    def _line(self, line: bytes) -> None:
        match = GRPC_HANDSHAKE_FAILED.match(line.decode("utf-8", "replace").rstrip("\n"))
        if match is not None:
            self._limited("handshake", "TLS handshake failed%s (a client without TLS, or one whose certificate "
                          "this server does not trust?)", match["detail"], level=logging.WARNING)
            return
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._stderr, view):]
        except OSError:  # the original stderr is gone: nothing to forward to
            pass
