"""Self-signed certificates for the TLS tests: a CA, a server certificate for 127.0.0.1, and
a client certificate for mutual TLS, written as PEM files."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Certificates:
    ca: Path  # what clients trust (and the server, for mutual TLS)
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _certificate(subject: str, key, issuer: str, issuer_key, ca: bool = False, hosts: tuple[str, ...] = ()):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if hosts:
        names = [x509.IPAddress(ipaddress.ip_address(h)) if h[0].isdigit() else x509.DNSName(h) for h in hosts]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certificates(directory: Path) -> Certificates:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, server_key, client_key = _key(), _key(), _key()
    ca = _certificate("conclave test CA", ca_key, "conclave test CA", ca_key, ca=True)
    server = _certificate("127.0.0.1", server_key, "conclave test CA", ca_key, hosts=("127.0.0.1", "localhost"))
    client = _certificate("student", client_key, "conclave test CA", ca_key)

    def pem(certificate, name: str) -> Path:
        (directory / name).write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        return directory / name

    return Certificates(pem(ca, "ca.pem"), pem(server, "server.pem"), _write_key(server_key, directory / "server.key"),
                        pem(client, "client.pem"), _write_key(client_key, directory / "client.key"))
