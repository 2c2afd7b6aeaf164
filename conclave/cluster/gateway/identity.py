"""Round keys signed by an owner's identity, so that whoever relays them (the coordinator) cannot swap them.

A gateway signs each round's ephemeral X25519 public key, with the round's public terms (run,
round, batch, classes, σ, its cell bound), using its TLS private key (EC P-256, ECDSA-SHA256). A
verifier accepts a key only if the certificate sent with it was issued by the consortium CA, names
the claimed owner as its common name, and the signature holds over exactly those fields. The secure
sum's plan is a function of these signed fields alone, so every party and the coordinator agree on
it, and a coordinator that holds no owner's private key can neither forge a key nor move one to
another round, run or owner. A DP-SGD step's key (``StepKey``) signs the step's plan terms (the
trainable entries d, the clip bound, the scale γ, the noise multiplier, q, the steps) under a
context of its own, so a step's key never passes for a vote round's, nor the other way round.
"""
from __future__ import annotations

import datetime
import struct
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from conclave.cluster.tls import CertificateError
from conclave.errors import ConclaveError

SIGNATURE_CONTEXT = b"conclave/owner-round-key/v1"
STEP_SIGNATURE_CONTEXT = b"conclave/owner-step-key/v1"
X25519_KEY_BYTES = 32


class ForgedKey(ConclaveError, ValueError):
    """A round key that does not verify (one line saying why)."""


@dataclass(frozen=True)
class RoundKey:
    """What a gateway signs for one round: whose key it is and the round's public terms."""

    owner: str
    public_key: bytes
    cell_bound: int
    run: str
    round: int
    batch: int
    classes: int
    sigma: float

    def signed_bytes(self) -> bytes:
        """The fields, length-prefixed in a fixed order: two different keys never sign the same bytes."""
        fields = (SIGNATURE_CONTEXT, self.owner.encode(), self.public_key, self.run.encode(),
                  struct.pack(">qqqqd", self.cell_bound, self.round, self.batch, self.classes, self.sigma))
        return b"".join(len(f).to_bytes(4, "big") + f for f in fields)


@dataclass(frozen=True)
class StepKey:
    """What a gateway signs for one DP-SGD step (``round``: the step id): whose key it is, its
    declared ``records`` and every term the step's secure-sum plan depends on."""

    owner: str
    public_key: bytes
    records: int
    run: str
    round: int
    dimension: int
    max_grad_norm: float
    scale_bits: int
    noise_multiplier: float
    sample_rate: float
    steps: int

    def signed_bytes(self) -> bytes:
        fields = (STEP_SIGNATURE_CONTEXT, self.owner.encode(), self.public_key, self.run.encode(),
                  struct.pack(">qqqqqddd", self.records, self.round, self.dimension, self.scale_bits, self.steps,
                              self.max_grad_norm, self.noise_multiplier, self.sample_rate))
        return b"".join(len(f).to_bytes(4, "big") + f for f in fields)

    def terms(self) -> tuple:
        """The step's terms, the same in every party's key: everything but whose key it is."""
        return (self.run, self.round, self.dimension, self.max_grad_norm, self.scale_bits, self.noise_multiplier,
                self.sample_rate, self.steps)


class Identity:
    """This gateway's signing identity: its certificate (PEM, sent with every key) and private key."""

    def __init__(self, certificate: Path, key: Path) -> None:
        self.certificate_pem = Path(certificate).read_bytes()
        private = serialization.load_pem_private_key(Path(key).read_bytes(), password=None)
        if not isinstance(private, ec.EllipticCurvePrivateKey):
            raise CertificateError(f"{key}: a gateway signs with an EC key (as cluster.tls issues), not "
                                   f"{type(private).__name__}")
        self._key = private

    def sign(self, key: RoundKey | StepKey) -> bytes:
        return self._key.sign(key.signed_bytes(), ec.ECDSA(hashes.SHA256()))


class Verifier:
    """Checks signed round keys against the consortium CA."""

    def __init__(self, ca: Path) -> None:
        self._ca = x509.load_pem_x509_certificate(Path(ca).read_bytes())

    def verify(self, key: RoundKey | StepKey, certificate_pem: bytes, signature: bytes) -> None:
        """``ForgedKey`` unless ``certificate_pem`` chains to the CA, names ``key.owner`` and signed ``key``."""
        if len(key.public_key) != X25519_KEY_BYTES:
            raise ForgedKey(f"owner {key.owner}'s round key is {len(key.public_key)} bytes, not an X25519 key")
        try:
            certificate = x509.load_pem_x509_certificate(certificate_pem)
        except ValueError:
            raise ForgedKey(f"owner {key.owner}'s round key comes with no PEM certificate") from None
        try:
            certificate.verify_directly_issued_by(self._ca)
        except (ValueError, TypeError, InvalidSignature):
            raise ForgedKey(f"owner {key.owner}'s certificate is not issued by the consortium CA") from None
        now = datetime.datetime.now(datetime.timezone.utc)
        if not certificate.not_valid_before_utc <= now <= certificate.not_valid_after_utc:
            raise ForgedKey(f"owner {key.owner}'s certificate is not valid now")
        names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if [n.value for n in names] != [key.owner]:
            raise ForgedKey(f"a round key claims owner {key.owner}, but its certificate names "
                            f"{', '.join(str(n.value) for n in names) or 'no one'}")
        public = certificate.public_key()
        if not isinstance(public, ec.EllipticCurvePublicKey):
            raise ForgedKey(f"owner {key.owner}'s certificate holds no EC key")
        try:
            public.verify(signature, key.signed_bytes(), ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            raise ForgedKey(f"owner {key.owner}'s round key is not signed by that owner (swapped or altered)") from None
