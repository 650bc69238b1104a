"""Peer-memory all-reduce set-up: ranks whose processes made different numbers of set-ups before
(PyTorch pairs them by that order in each process) all fall back to NCCL at once, and say so,
instead of waiting on each other until the store's timeout (here: the store's get of a word rank 1
never wrote would raise after 5 s)."""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from splitserve.engine.parallel import peer_all_reduce


def test_ranks_whose_processes_made_different_numbers_of_setups_use_nccl(caplog):
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    before = peer_all_reduce._SETUPS
    # NOTE: rank 1's process (a new follower) has made none; this one pretends to have made one
    store.set("symm-mem/g/setups/1", str(before + 1 if before == 0 else 0))
    with caplog.at_level(logging.WARNING):
        got = peer_all_reduce.try_peer_all_reduce(
            store, "g", 0, 2, torch.device("cpu"), None, 1 << 20
        )
    assert got is None
    assert before == peer_all_reduce._SETUPS  # nothing tried, nothing counted
    assert "different numbers of peer-memory set-ups" in caplog.text
