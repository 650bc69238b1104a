"""Which refused one-sided pushes fail a live reservation: any under its own fence (or a
greater one); a stale writer's (an older fence) only where its bytes may lie over KV the
reservation keeps, a block that landed already or its cached prefix."""

from __future__ import annotations

import pytest

from splitserve.decode_service.reservations import LocalReservation, ReservationBook

BLOCKS = (4, 5, 6, 7)  # block 4 holds the cached prefix (16 tokens)


@pytest.fixture
def book() -> ReservationBook:
    book = ReservationBook()
    book.add(LocalReservation("req", fence=10, block_ids=BLOCKS, num_cached_tokens=16,
                              block_size=16))  # fmt: skip
    book.landed("req", 10, [5], 64)
    return book


@pytest.mark.parametrize(
    ("fence", "blocks", "fails"),
    [
        (10, [6], True),  # the live writer's own push refused: its blocks will not come
        (11, [6], True),  # a fence the decode worker never issued
        (9, [6, 7], False),  # a stale writer over blocks the live writer fills later
        (9, [20, 21], False),  # a stale writer elsewhere
        (9, [5, 6], True),  # ... over a block that landed already
        (9, [4], True),  # ... over the cached prefix, which nobody writes again
    ],
)
def test_a_refusal_fails_the_reservation_only_when_it_may_have_spoiled_its_kv(
    book, fence, blocks, fails
):
    assert book.refused("req", fence, blocks, "refused") is fails
    res = book.get("req")
    assert res is not None
    assert (res.refusal is not None) is fails
    book.landed("req", 10, [6, 7], 128)
    assert res.wait_complete(0.1) is not fails


def test_a_refusal_for_a_request_without_a_reservation_changes_nothing(book):
    assert book.refused("other", 10, [6], "refused") is False
    book.pop("req")
    assert book.refused("req", 10, [6], "refused") is False
