"""Workers' registry records sealed with the cluster secret, and checked on read.

A worker's advertisement (`{ns}:worker:{kind}:{id}`) and its KV endpoint (`{ns}:kv_endpoint:{id}`)
carry a `mac` field: HMAC-SHA256, keyed by the cluster secret, over the record's key and every
other field. Whoever can write to Redis but is not a member (a shared Redis, a leaked Redis
password) can't forge one: a reader with the secret ignores, and logs, a record whose seal is
missing or wrong, so no gateway routes a prompt to a worker a member did not advertise and no
prefill worker sends KV to, or takes a NIXL agent from, an endpoint a member did not publish.
With no cluster secret there is nothing to seal with, and records are taken as they are.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections import OrderedDict
from collections.abc import Mapping

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
    """Seals records with the cluster `secret` and checks them (no secret: records are taken as
    they are). A record that fails is logged once per key, not on every read: the gateway reads
    the workers' records for every request."""

    def __init__(self, secret: str, remember: int = 1024) -> None:
        self._secret = secret
        self._warned: OrderedDict[str, None] = OrderedDict()
        self._remember = remember

    def seal(self, key: str, fields: Mapping[str, bytes]) -> dict[str, bytes]:
        """`fields` plus their seal (unchanged without a secret)."""
        if not self._secret:
            return dict(fields)
        return {**fields, MAC_FIELD: _digest(self._secret, key, fields).encode()}

    def verified(self, key: str, fields: Mapping[str, bytes]) -> bool:
        """True if the record's seal is right (always, without a secret); a wrong or missing
        one is logged (key only: never the record's contents)."""
        if not self._secret:
            return True
        given = fields.get(MAC_FIELD, b"")
        if hmac.compare_digest(given, _digest(self._secret, key, fields).encode()):
            return True
        if key not in self._warned:
            self._warned[key] = None
            while len(self._warned) > self._remember:
                self._warned.popitem(last=False)
            log.warning(
                "ignored registry record %r: its seal is %s (written by a non-member?)",
                key,
                "wrong" if given else "missing",
            )
        return False
