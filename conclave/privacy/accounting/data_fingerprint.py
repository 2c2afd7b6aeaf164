"""Which version of an owner's data paid for a charge, without revealing a record.

The fingerprint of the owner's files is an HMAC under a key that never leaves the owner's node
(``<owner>.key`` beside its ledger, mode 0600); it goes with each charge in the owner's own ledger
and nowhere else: whether the data changed between runs is itself a fact about the records.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path


def data_fingerprint(owner: str, ledger_path: Path, data_paths: tuple[str, ...]) -> str:
    """HMAC-SHA256 of ``owner``'s files under a key kept beside its ledger (never sent), 16 hex digits."""
    key_file = ledger_path.with_name(f"{owner}.key")
    if not key_file.exists():
        descriptor = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(secrets.token_bytes(32))
    digest = hmac.new(key_file.read_bytes(), digestmod=hashlib.sha256)
    for root in data_paths:
        base = Path(root).expanduser()
        files = sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else [base]
        for file in files:
            if file.exists():
                digest.update(str(file.relative_to(base) if base.is_dir() else file.name).encode())
                with file.open("rb") as data:
                    for block in iter(lambda: data.read(1 << 20), b""):
                        digest.update(block)
    return digest.hexdigest()[:16]
