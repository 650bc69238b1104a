"""Leases on request records: one that lapses shows in `expired_requests`; `renew_many`
extends many in one call and names those it could not (a real redis-server)."""

from __future__ import annotations

import time

from splitserve.kv_transfer.registry import Registry

TTL_S = 0.3
LEASE_S = 5.0


def test_lapsed_lease_makes_the_request_appear_in_expired_requests(registry: Registry) -> None:
    short = registry.reserve("dies", "d0", [1], lease_s=TTL_S)
    renewed = registry.reserve("renewed", "d0", [2], lease_s=TTL_S)
    registry.reserve("long", "d0", [3], lease_s=LEASE_S)
    registry.begin_write("dies", "p0", short.fence, lease_s=TTL_S)  # then P "crashes"
    time.sleep(0.1)
    assert registry.renew("renewed", renewed.fence, lease_s=LEASE_S)
    time.sleep(TTL_S + 0.05)
    candidates = ["dies", "renewed", "long", "never-reserved"]
    assert registry.expired_requests(candidates) == {"dies", "never-reserved"}
    assert registry.expired_requests([]) == set()
    assert registry.request_record_keys() == ["test:req:long", "test:req:renewed"]


def test_renew_many_extends_the_leases_it_can_in_one_call_and_names_the_rest(
    registry: Registry,
) -> None:
    a = registry.reserve("a", "d0", [1], lease_s=TTL_S)
    b = registry.reserve("b", "d0", [2], lease_s=TTL_S)
    stale = registry.reserve("stale", "d0", [3], lease_s=TTL_S)
    lost = registry.renew_many(
        {"a": a.fence, "gone": a.fence, "b": b.fence, "stale": stale.fence - 1}, LEASE_S
    )
    assert lost == {"gone", "stale"}
    assert registry.renew_many({}, LEASE_S) == set()
    time.sleep(TTL_S + 0.05)
    assert registry.expired_requests(["a", "b", "stale"]) == {"stale"}
