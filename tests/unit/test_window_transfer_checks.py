"""The bookkeeping under a window pool's transfers: a reservation's blocks get window slots only
where its first query looks; a transfer's window pins keep a slot from going to another block;
a receiver takes exactly the slots the reservation gave the pushed blocks; a gRPC header's
window slots are checked against the pool before any byte is read."""

from __future__ import annotations

import pytest
import torch

from splitserve.decode_service.reservations import LocalReservation, ReservationBook
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.window_slots import WindowSlots
from splitserve.kv_transfer.transport import PushRefused
from splitserve.kv_transfer.wire import (
    BlockNotAllowedError,
    CacheLayout,
    LayoutMismatchError,
    make_header,
    validate_header,
)

BS, WINDOW = 16, 32


def manager(num_blocks: int = 32, num_slots: int = 12) -> BlockManager:
    return BlockManager(num_blocks, BS, window=WindowSlots(num_slots, WINDOW, BS))


def test_a_reservation_slots_only_the_blocks_its_first_query_sees() -> None:
    bm = manager()
    n = 10 * BS + 3  # 11 blocks; the query at n - 1 sees positions > n - 1 - WINDOW
    assert bm.allocate("r", n, None, num_computed=n - 1) is not None
    table = bm.block_table("r")
    slotted = [i for i, b in enumerate(table) if bm.window_slot(b)]
    assert slotted == [8, 9, 10]  # (n - 1 - WINDOW + 1) // BS = 8
    bm.check_integrity()
    # Without it (a sequence computed here) every block needs a slot: more than the pool has.
    assert not bm.can_allocate("s", 12 * BS)
    bm.free("r")
    bm.check_integrity()


def test_a_window_pin_keeps_a_slot_from_another_block_until_unpinned() -> None:
    bm = manager(num_slots=4)  # 3 slots besides the null one
    assert bm.allocate("a", 3 * BS) is not None
    first = bm.block_table("a")[0]
    slot = bm.pin(first, window=True)
    assert slot == bm.window_slot(first) != 0
    bm.free("a")
    assert not bm.can_allocate("b", 3 * BS)  # the pinned slot is not idle: two left
    assert bm.allocate("b", 2 * BS) is not None
    assert bm.window_slot(first) == slot
    bm.check_integrity()
    bm.unpin(first, window=True)
    bm.free("b")
    bm.check_integrity()
    assert bm.usage().num_window_slots_held == 0


def test_a_receiver_takes_exactly_the_reserved_slots_of_the_pushed_blocks() -> None:
    book = ReservationBook()
    book.add(LocalReservation("r", 1, (7, 8, 9), 0, BS, window_slots=(0, 4, 5)))
    book.check_window("r", 1, [7, 8, 9], [4, 5])
    book.check_window("r", 1, [7], [])
    for blocks, slots in (([8, 9], [4]), ([8, 9], [5, 4]), ([7], [4]), ([9], [6])):
        with pytest.raises(PushRefused, match="window slots") as refused:
            book.check_window("r", 1, blocks, slots)
        assert refused.value.status == "FAILED_PRECONDITION"


def test_a_header_with_window_slots_is_checked_against_the_pool() -> None:
    layout = CacheLayout(1, BS, 2, 8, torch.float32, window_layers=3)
    assert layout.slot_bytes == 3 * layout.block_bytes
    size = layout.payload_bytes(2, 1)
    header = make_header("r", 1, layout, [3, 4], size, 0, 40, dst_window_slots=[5])
    validate_header(header, layout, 10, {3, 4}, num_pool_slots=6)
    with pytest.raises(BlockNotAllowedError, match="outside the pool"):
        validate_header(header, layout, 10, {3, 4}, num_pool_slots=5)
    with pytest.raises(LayoutMismatchError, match="sliding layers"):
        validate_header(header, CacheLayout(1, BS, 2, 8, torch.float32), 10, None, 6)
