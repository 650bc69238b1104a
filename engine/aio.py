"""A small asyncio helper shared by the async servicers."""

from __future__ import annotations

import asyncio
from typing import Any


async def settled(future: asyncio.Future[Any]) -> None:
    """Until `future` is done, whatever cancels the waiter meanwhile (its outcome is dropped):
    so that work running in a thread (on buffers, on the engine) is over before cleanup."""
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            continue
    if not future.cancelled():
        future.exception()  # NOTE: retrieved, so asyncio does not log it as never retrieved
