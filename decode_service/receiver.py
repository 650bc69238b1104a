"""Where pushed KV blocks land: checks each push against the request's reservation, then
writes the blocks straight into the engine's cache.

NOTE: writing from a transfer thread while the engine thread runs is safe because reserved
blocks belong to no running sequence until `Decode` admits the request, and a reservation is
marked dead (under its lock) before its blocks can be freed.
"""

from __future__ import annotations

from collections.abc import Collection

import grpc

from splitserve.decode_service.reservations import ReservationBook
from splitserve.kv_transfer.wire import Buffer, CacheLayout, PushRefused, unpack_into
from splitserve.protos.v1 import kv_transfer_pb2


class ReservationReceiver:
    """The `KVReceiver` of a decode worker."""

    def __init__(self, kv_caches: list, reservations: ReservationBook) -> None:
        self.kv_caches = kv_caches
        self.reservations = reservations
        self._layout = CacheLayout.from_kv_caches(kv_caches)
        self.num_bytes_received = 0
        self.num_blocks_received = 0

    def layout(self) -> CacheLayout:
        return self._layout

    def check_push(self, header: kv_transfer_pb2.KVTransferHeader) -> Collection[int]:
        res = self.reservations.get(header.request_id)
        if res is None:
            raise PushRefused(
                grpc.StatusCode.NOT_FOUND, f"no reservation for request {header.request_id!r}"
            )
        if header.fence != res.fence:
            raise PushRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stale fencing token {header.fence} for request {header.request_id!r}",
            )
        return res.needed

    def on_blocks(self, header: kv_transfer_pb2.KVTransferHeader, payload: Buffer) -> None:
        res = self.reservations.get(header.request_id)
        if res is None:
            raise PushRefused(
                grpc.StatusCode.NOT_FOUND, f"no reservation for request {header.request_id!r}"
            )
        with res.lock:
            if res.dead or header.fence != res.fence:
                raise PushRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"reservation of {header.request_id!r} was reclaimed or replaced",
                )
            unpack_into(self.kv_caches, header, payload, verify=False)  # the servicer verified
            res.received.update(header.dst_block_ids)
        self.num_bytes_received += len(payload)
        self.num_blocks_received += len(header.dst_block_ids)
