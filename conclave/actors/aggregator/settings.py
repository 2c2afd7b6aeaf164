"""Where the aggregator listens, who may call it, and how much it takes on at once."""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from conclave.errors import InvalidValue


@dataclass(frozen=True)
class ServerSettings:
    """Where the aggregator listens, who may call it, and how much it takes on at once.

    ``port=0`` picks a free port (``AggregatorServer.start`` returns the bound address).
    With ``token`` set, Aggregator calls need ``authorization: Bearer <token>`` metadata.
    With ``tls_cert`` and ``tls_key`` (PEM files) the port speaks TLS; with ``tls_client_ca``
    too, clients must present a certificate that CA signed (mutual TLS). A non-loopback
    ``host`` without TLS is refused unless ``allow_plaintext`` (the token would travel in clear).
    """

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None
    max_batch: int = 1024
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    allow_plaintext: bool = False
    label_workers: int = 8  # threads doing label work (each may wait on the teachers)
    max_queued: int = 64  # label calls waiting for a thread; more → UNAVAILABLE
    max_streams: int = 64  # LabelStreams open at once (half per client address); more → UNAVAILABLE
    max_unauthenticated: int = 32  # health Watch streams open at once, and reflection streams (half per
    # client address); more → RESOURCE_EXHAUSTED. Unary health Check calls are never capped.
    stream_idle_timeout: float = 60.0  # seconds a stream may wait for its next request
    health_interval: float = 2.0  # seconds between checks that every teacher can vote

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidValue(f"port must be in 0..65535, got {self.port}")
        if self.max_batch < 1:
            raise InvalidValue(f"max_batch must be at least 1, got {self.max_batch}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidValue("TLS needs both tls_cert and tls_key (PEM files), or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise InvalidValue("tls_client_ca (mutual TLS) needs tls_cert and tls_key too")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise InvalidValue(f"{name}: no such file {path}")
        if self.token is not None and not self.token:
            raise InvalidValue("token must be non-empty (or None for no authentication)")
        if not self.tls_cert and not self.allow_plaintext and not is_loopback(self.host):
            raise InvalidValue(f"host {self.host!r} is reachable from other machines: serve it with TLS "
                             "(tls_cert, tls_key), or allow plaintext explicitly")
        for name in ("label_workers", "max_streams", "max_unauthenticated"):
            if getattr(self, name) < 1:
                raise InvalidValue(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_queued < 0:
            raise InvalidValue(f"max_queued must be >= 0, got {self.max_queued}")
        if self.stream_idle_timeout <= 0 or self.health_interval <= 0:
            raise InvalidValue("stream_idle_timeout and health_interval must be positive")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback one (127.0.0.0/8, ::1), as
    the server would bind it: ``localhost``, ``127.1``, ``[::1]``. By address family, not by
    spelling; a host that does not resolve is not known to be loopback."""
    try:
        resolved = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):  # socket.gaierror; a name too long for IDNA
        return False
    addresses = [ipaddress.ip_address(address[4][0].split("%")[0]) for address in resolved]
    return bool(addresses) and all(_unmapped(address).is_loopback for address in addresses)



def _unmapped(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``::ffff:127.0.0.1`` as the IPv4 address it carries."""
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return mapped or address
