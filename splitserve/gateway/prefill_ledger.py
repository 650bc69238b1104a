"""Where the prompt tokens in flight on each prefill worker are counted (`admission.PrefillBudget`
decides who waits; a ledger only counts): in this process, or in Redis across every gateway
replica, so that `--max-prefill-tokens-per-worker` bounds a worker's load however many gateway
processes or replicas feed it.

    {ns}:gw:prefill:{worker_id}   hash   replica id -> prompt tokens it has in flight there
    {ns}:gw:alive:{replica}       string while the replica lives (PX lease, renewed by it:
                                          gateway/replicas.py); a dead replica's tokens no
                                          longer count once it lapses

A take checks the room and counts the tokens in one Lua call, so two replicas never both fill
the last room; a request costs one read, one take and one give, never a call per token.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import redis

from splitserve.gateway.redis_breaker import Breaker

# The live replicas' tokens in one worker's hash (a dead replica's field is dropped on the way).
_USED = """
local function used(key, prefix)
  local total = 0
  local fields = redis.call('HGETALL', key)
  for i = 1, #fields, 2 do
    if redis.call('EXISTS', prefix .. fields[i]) == 1 then
      total = total + tonumber(fields[i + 1])
    else
      redis.call('HDEL', key, fields[i])
    end
  end
  return total
end
"""

# KEYS: the workers' hashes. ARGV: alive-key prefix. Their tokens in flight, in order.
USED = (
    _USED
    + """
local out = {}
for i, key in ipairs(KEYS) do out[i] = used(key, ARGV[1]) end
return out
"""
)

# KEYS: one worker's hash. ARGV: alive-key prefix, replica, tokens, most per worker.
# 1 if taken (the worker was idle, or has room), else 0.
TAKE = (
    _USED
    + """
local total = used(KEYS[1], ARGV[1])
local n, most = tonumber(ARGV[3]), tonumber(ARGV[4])
if total == 0 or total + n <= most then
  redis.call('HINCRBY', KEYS[1], ARGV[2], n)
  return 1
end
return 0
"""
)

# KEYS: one worker's hash. ARGV: replica, tokens.
GIVE = """
local left = redis.call('HINCRBY', KEYS[1], ARGV[1], -tonumber(ARGV[2]))
if left <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return left
"""


class PrefillLedger(abc.ABC):
    """Prompt tokens in flight per prefill worker. `blocking` ledgers are called in threads."""

    blocking = False

    @abc.abstractmethod
    def used(self, worker_ids: Sequence[str]) -> dict[str, int]:
        """Tokens in flight on each of `worker_ids` (0 for an idle one)."""

    @abc.abstractmethod
    def take(self, worker_id: str, num_tokens: int, most: int) -> bool:
        """Count `num_tokens` on the worker if it is idle or has room under `most`."""

    @abc.abstractmethod
    def give(self, worker_id: str, num_tokens: int) -> None:
        """Stop counting `num_tokens` of this process's on the worker."""


class LocalLedger(PrefillLedger):
    """This process's requests only (one gateway process, or a test)."""

    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}

    def used(self, worker_ids: Sequence[str]) -> dict[str, int]:
        return {w: self._tokens.get(w, 0) for w in worker_ids}

    def take(self, worker_id: str, num_tokens: int, most: int) -> bool:
        used = self._tokens.get(worker_id, 0)
        if used and used + num_tokens > most:
            return False
        self._tokens[worker_id] = used + num_tokens
        return True

    def give(self, worker_id: str, num_tokens: int) -> None:
        left = self._tokens.get(worker_id, 0) - num_tokens
        if left > 0:
            self._tokens[worker_id] = left
        else:
            self._tokens.pop(worker_id, None)


class RedisLedger(PrefillLedger):
    """Every gateway replica's requests, in Redis (see the module doc). If Redis can't be
    reached, this replica counts alone until it can (its own requests still wait for room)."""

    blocking = True

    def __init__(self, client: redis.Redis, replica_id: str, namespace: str) -> None:
        self._client = client
        self.replica_id = replica_id
        self._ns = namespace
        self._alive_prefix = f"{namespace}:gw:alive:"
        self._used = client.register_script(USED)
        self._take = client.register_script(TAKE)
        self._give = client.register_script(GIVE)
        self._local = LocalLedger()
        self._breaker = Breaker("prefill budgets")

    def _key(self, worker_id: str) -> str:
        return f"{self._ns}:gw:prefill:{worker_id}"

    def used(self, worker_ids: Sequence[str]) -> dict[str, int]:
        if not worker_ids:
            return {}
        if self._breaker.is_open:
            return self._local.used(worker_ids)
        try:
            totals = self._used(keys=[self._key(w) for w in worker_ids], args=[self._alive_prefix])
        except redis.RedisError as exc:
            self._unreachable(exc)
            return self._local.used(worker_ids)
        self._breaker.answered()
        return {w: int(t) for w, t in zip(worker_ids, totals, strict=True)}

    def take(self, worker_id: str, num_tokens: int, most: int) -> bool:
        if self._breaker.is_open:
            return self._local.take(worker_id, num_tokens, most)
        try:
            taken = self._take(
                keys=[self._key(worker_id)],
                args=[self._alive_prefix, self.replica_id, num_tokens, most],
            )
        except redis.RedisError as exc:
            self._unreachable(exc)
            return self._local.take(worker_id, num_tokens, most)
        if taken:
            self._local.take(worker_id, num_tokens, 1 << 62)  # NOTE: what to give back alone
        return bool(taken)

    def give(self, worker_id: str, num_tokens: int) -> None:
        self._local.give(worker_id, num_tokens)
        if self._breaker.is_open:
            return
        try:
            self._give(keys=[self._key(worker_id)], args=[self.replica_id, num_tokens])
        except redis.RedisError as exc:
            self._unreachable(exc)

    def _unreachable(self, exc: BaseException) -> None:
        self._breaker.failed(exc)
