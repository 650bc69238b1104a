"""The registry's prefix index is bounded by what the workers' caches hold: a fixed figure of
Redis memory per (block, worker) entry, all of it given back as blocks leave the caches or a
worker leaves, and prefill and decode workers' entries alike (a real redis-server). Its change
log (prefix_events.py) is bounded by its length instead, and measured apart."""

from __future__ import annotations

import hashlib

import redis

from splitserve.kv_transfer.prefix_events import EVENT_MAX_HASHES, EVENTS_MAXLEN, events_key
from splitserve.kv_transfer.registry import Registry

BLOCKS = 2000
# Redis memory one resident block costs the index, per worker holding it: its key (a 16-byte
# hash in hex under the namespace), the worker's id in that key's set, and the hash in the
# worker's own set. Measured 335 bytes (2026-12-07, the suite's redis-server); the bound
# leaves room for allocator rounding across Redis versions.
BYTES_PER_ENTRY = 400


def _hashes(seed: int, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=16).digest() for i in range(n)]


def _log(client: redis.Redis) -> int:
    """The change log's memory (all of its entries counted)."""
    return int(client.memory_usage(events_key("test"), samples=0) or 0)


def _used(client: redis.Redis) -> int:
    """Redis memory, less the change log's (bounded by its length: tested below)."""
    return int(client.info("memory")["used_memory"]) - _log(client)


def test_the_index_costs_a_fixed_figure_per_resident_block_and_gives_it_back(
    registry: Registry, redis_client: redis.Redis
):
    # NOTE: the lookup's and the clear's Lua scripts load into Redis on first use, a fixed cost
    # (about 50 KB) that is no index entry: loaded before the baseline.
    registry.prefix_match(_hashes(0, 10))
    registry.clear_prefix_blocks("nobody")
    base = _used(redis_client)
    decode, prefill = _hashes(1, BLOCKS), _hashes(2, BLOCKS)
    registry.add_prefix_blocks("decode-0", decode)
    registry.add_prefix_blocks("prefill-0", prefill)
    registry.add_prefix_blocks("prefill-1", decode[: BLOCKS // 2])  # shared: one key, two ids
    entries = 2 * BLOCKS + BLOCKS // 2
    per_entry = (_used(redis_client) - base) / entries
    assert per_entry <= BYTES_PER_ENTRY, f"{per_entry:.0f} bytes per entry"
    matched = registry.prefix_match(decode[:10])
    assert matched == {"decode-0": 10, "prefill-1": 10}
    # Blocks evicted from a cache, and a worker leaving, take their entries with them.
    registry.remove_prefix_blocks("decode-0", decode)
    registry.clear_prefix_blocks("prefill-0")
    registry.clear_prefix_blocks("prefill-1")
    assert registry.prefix_match(decode[:10]) == {}
    assert registry.prefix_index_workers() == set()
    assert _used(redis_client) - base < 0.05 * entries * per_entry


def test_the_change_log_is_trimmed_to_its_length(registry: Registry, redis_client: redis.Redis):
    # A full entry (the most hashes one takes) costs a fixed figure: its hashes, its fields,
    # and (larger than a stream node's 4 KB) a node of its own.
    for i in range(100):
        registry.add_prefix_blocks(f"decode-{i % 4}", _hashes(i, EVENT_MAX_HASHES))
    per_entry = _log(redis_client) / redis_client.xlen(events_key("test"))
    assert per_entry <= 16 * EVENT_MAX_HASHES + 1024, f"{per_entry:.0f} bytes per log entry"
    # However many changes come, the log keeps about its length.
    for i in range(EVENTS_MAXLEN + EVENTS_MAXLEN // 2):
        registry.remove_prefix_blocks(f"decode-{i % 4}", _hashes(i, 1))
    # NOTE: trimmed "~": whole stream nodes (100 entries by default) at a time
    assert EVENTS_MAXLEN <= redis_client.xlen(events_key("test")) <= EVENTS_MAXLEN + 200
