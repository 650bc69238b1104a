"""Forming a tensor-parallel group is bounded: rank 0 notices a rank that died after joining
at once, and a degree the host has no GPUs for is refused before any rank starts."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch

from splitserve.engine.parallel.group import Rendezvous, TorchGroup
from splitserve.engine.parallel.launcher import RankLost, check_devices
from splitserve.engine.parallel.sharding import Shard

# A rank that joins the rendezvous and dies before it builds its backend.
_JOIN_AND_DIE = """
import datetime, sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False,
                      timeout=datetime.timedelta(seconds=60))
store.set("joined/1", "1")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_rank_0_fails_at_once_when_a_rank_dies_after_joining():
    port = _free_port()
    rank1 = subprocess.Popen([sys.executable, "-c", _JOIN_AND_DIE, str(port)])

    def check_peers() -> None:
        if rank1.poll() is not None:
            raise RankLost(f"rank 1 exited with code {rank1.returncode}")

    rendezvous = Rendezvous("127.0.0.1", port, timeout_s=60.0, join_timeout_s=60.0)
    start = time.monotonic()
    try:
        with pytest.raises(RankLost, match="rank 1 exited with code 0"):
            TorchGroup(Shard(0, 2), rendezvous, torch.device("cpu"), check_peers)
    finally:
        rank1.kill()
        rank1.wait()
    # NOTE: gloo would wait out its 60 s connect timeout; the watch ends it within a poll.
    assert time.monotonic() - start < 30


def test_a_degree_with_too_few_gpus_is_refused_before_any_rank_starts():
    first = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU this process sees
    with pytest.raises(ValueError, match="tensor_parallel_size 2 from cuda:.* needs GPUs"):
        check_devices(first, 2)
    check_devices("cpu", 4)  # every CPU rank shares the CPU
