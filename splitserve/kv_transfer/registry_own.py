"""A worker's own registry records, guarded: what it last wrote under its keys (its worker record,
its KV endpoint), so that a heartbeat that finds something else there (someone with Redis's
password wrote it: a changed value, an added field, a seal that fails) logs it and rewrites it
at once, instead of the worker staying ignored until it re-registers. Part of `Registry`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import redis

from splitserve.kv_transfer.registry_records import as_bytes, as_text

log = logging.getLogger("splitserve.registry")


def stored(raw: Mapping[Any, Any]) -> dict[str, bytes]:
    """A hash as stored, read or about to be written, in one form to compare."""
    return {as_text(k): as_bytes(v) for k, v in raw.items()}


class OwnRecords:
    """The guard's calls of `Registry`, over the registry's client."""

    _client: redis.Redis
    _written: dict[str, dict[str, bytes]]  # key -> what this registry last wrote there

    def _check_own(
        self, key: str, found: Mapping[Any, Any], wrote: Mapping[str, bytes], endpoint_key: str,
        endpoint: Mapping[Any, Any], ttl_ms: int,
    ) -> None:  # fmt: skip
        """After a heartbeat rewrote `key` whole: log if what it `found` there was not what it
        `wrote` last, and put the KV endpoint back if it was changed (or one appeared)."""
        if stored(found) != wrote:
            self._changed_by_another(key)
        published = self._written.get(endpoint_key, {})  # NOTE: none: there should be none
        if stored(endpoint) != published:
            self._changed_by_another(endpoint_key)
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(endpoint_key)
            if published:
                mapping: dict[Any, bytes] = dict(published)
                pipe.hset(endpoint_key, mapping=mapping)
                pipe.pexpire(endpoint_key, ttl_ms)
            pipe.execute()

    def _changed_by_another(self, key: str) -> None:
        # NOTE: Redis does not say who wrote a key: whoever holds its password (no cluster
        # secret is needed to write, only to seal).
        log.warning(
            "registry record %r was changed by someone else (its value is not what this worker "
            "wrote, or its seal fails); rewritten",
            key,
        )
