"""Workers' registry records sealed with the cluster secret, and checked on read.

A worker's advertisement (`{ns}:worker:{kind}:{id}`) and its KV endpoint (`{ns}:kv_endpoint:{id}`)
carry a `mac` field: HMAC-SHA256, keyed by the cluster secret, over the record's key and every
other field as stored (fields that grant access are encrypted first: registry_conceal.py).
Whoever can write to Redis but is not a member (a shared Redis, a leaked Redis password) can't
forge one: a reader with the secret ignores, and logs, a record whose seal is missing or wrong,
or whose concealed fields do not decrypt, so no gateway routes a prompt to a worker a member did
not advertise, no prefill worker sends KV to, or takes a NIXL agent from, an endpoint a member
did not publish, and no decode worker takes NIXL notifications from a sender no member vouched
for. With no cluster secret there is nothing to seal with, and records are taken as they are.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections import OrderedDict
from collections.abc import Mapping

from splitserve.kv_transfer.registry_conceal import Concealer, Unreadable, derive_key

log = logging.getLogger("splitserve.registry")

MAC_FIELD = "mac"


def _digest(secret: str, key: str, fields: Mapping[str, bytes]) -> str:
    mac = hmac.new(secret.encode(), key.encode(), hashlib.sha256)
    for name in sorted(fields):
        if name == MAC_FIELD:
            continue
        value = fields[name]
        for part in (name.encode(), value):
            mac.update(len(part).to_bytes(8, "big"))  # NOTE: length-prefixed: no ambiguity
            mac.update(part)
    return mac.hexdigest()


class Seal:
    """Seals records with the cluster `secret` (concealing the fields marked `Concealed`) and
    opens them on read (no secret: records are taken as they are). A record that fails is
    logged once per key, not on every read: the gateway reads the workers' records for every
    request."""

    def __init__(self, secret: str, remember: int = 1024) -> None:
        self._secret = secret
        self._concealer = Concealer(derive_key(secret) if secret else None)
        self._warned: OrderedDict[str, None] = OrderedDict()
        self._remember = remember

    def seal(self, key: str, fields: Mapping[str, bytes]) -> dict[str, bytes]:
        """`fields` as stored: concealed ones encrypted, and their seal (both only with a
        secret)."""
        stored = self._concealer.conceal(key, fields)
        if not self._secret:
            return stored
        return {**stored, MAC_FIELD: _digest(self._secret, key, stored).encode()}

    def opened(self, key: str, fields: Mapping[str, bytes]) -> dict[str, bytes] | None:
        """The record's fields (concealed ones decrypted, the seal left out), or None if its
        seal is wrong or missing or a concealed field does not decrypt; that is logged (key
        only: never the record's contents)."""
        if self._secret:
            given = fields.get(MAC_FIELD, b"")
            if not hmac.compare_digest(given, _digest(self._secret, key, fields).encode()):
                why = "wrong" if given else "missing"
                self._warn(key, f"its seal is {why} (written by a non-member?)")
                return None
        try:
            plain = self._concealer.reveal(key, fields)
        except Unreadable as e:
            self._warn(key, f"{e} (written under another cluster secret?)")
            return None
        plain.pop(MAC_FIELD, None)
        return plain

    def _warn(self, key: str, why: str) -> None:
        if key in self._warned:
            return
        self._warned[key] = None
        while len(self._warned) > self._remember:
            self._warned.popitem(last=False)
        log.warning("ignored registry record %r: %s", key, why)
