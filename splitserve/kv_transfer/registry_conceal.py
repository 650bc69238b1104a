"""Registry fields concealed at rest: encrypted with a key derived from the cluster secret.

Some endpoint fields grant access on their own: whoever loads a decode worker's NIXL metadata
(its UCX address and the pool's remote keys) can write into its KV pool, and a NIXL sender's
agent name is what its receivers take notifications by. A transport marks such a value
`Concealed` where it builds its endpoint; the registry stores it as `concealed:<name>`,
AES-256-GCM encrypted (a random 12-byte nonce per write; the record's key and the field's name
as associated data, so a ciphertext moved to another record or field does not open), and
members decrypt it on read. Whoever reads Redis without the cluster secret sees ciphertext.

The key is derived with HKDF-SHA256 under a purpose label of its own, so it is never the key the
seal's HMAC uses (registry_seal.py). With no cluster secret nothing is encrypted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PREFIX = "concealed:"
PURPOSE = b"splitserve registry: concealed endpoint fields v1"
NONCE_BYTES = 12


class Concealed(bytes):
    """An endpoint field's value that grants access to its worker: kept encrypted in Redis."""


class Unreadable(Exception):
    """A concealed field that does not decrypt (changed, or written under another secret)."""


def derive_key(secret: str) -> bytes:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=PURPOSE)
    return hkdf.derive(secret.encode())


def _associated(key: str, name: str) -> bytes:
    parts = (key.encode(), name.encode())
    return b"".join(len(p).to_bytes(8, "big") + p for p in parts)  # NOTE: no ambiguity


class Concealer:
    """Encrypts the `Concealed` fields of a record and decrypts them back (`key`: the cluster
    secret's derived key; None: no secret, nothing is encrypted)."""

    def __init__(self, key: bytes | None) -> None:
        self._aead = AESGCM(key) if key is not None else None

    def conceal(self, key: str, fields: Mapping[str, bytes]) -> dict[str, bytes]:
        """`fields` as stored: each `Concealed` one encrypted under `concealed:<name>`."""
        if self._aead is None:
            return {name: bytes(value) for name, value in fields.items()}
        out = {}
        for name, value in fields.items():
            if isinstance(value, Concealed):
                nonce = os.urandom(NONCE_BYTES)
                sealed = self._aead.encrypt(nonce, bytes(value), _associated(key, name))
                out[PREFIX + name] = nonce + sealed
            else:
                out[name] = bytes(value)
        return out

    def reveal(self, key: str, fields: Mapping[str, bytes]) -> dict[str, bytes]:
        """`fields` as read, with every concealed one decrypted under its own name; raises
        Unreadable if one does not decrypt (or there is no key to decrypt it with)."""
        out = {}
        for name, value in fields.items():
            if not name.startswith(PREFIX):
                out[name] = value
                continue
            plain = name.removeprefix(PREFIX)
            if self._aead is None:
                raise Unreadable("it is encrypted and this process has no cluster secret")
            nonce, sealed = value[:NONCE_BYTES], value[NONCE_BYTES:]
            try:
                out[plain] = self._aead.decrypt(nonce, sealed, _associated(key, plain))
            except (InvalidTag, ValueError) as e:
                raise Unreadable(f"its field {plain!r} does not decrypt") from e
        return out
