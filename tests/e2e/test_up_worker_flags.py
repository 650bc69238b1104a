"""`splitserve up` with worker flags, as a user runs it (a real process on the tiny model): each
worker's effective config, as its heartbeat record in the registry tells it, carries the general
flags and its own role's overrides, the gateway the block size it shares, and a request goes
through the whole stack (cli/up_flags.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from splitserve.client import collect, connect, stream
from splitserve.engine import SamplingParams
from splitserve.kv_transfer.registry import Registry
from splitserve.protos.v1 import gateway_pb2

pytestmark = pytest.mark.slow


def test_up_worker_flags_reach_each_workers_effective_config(
    tiny_models, redis_server, redis_client, tmp_path
):
    """On the session's Redis (`redis_client` empties it), so that the records can be read."""
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "up", "--model", str(tiny_models["llama"]),
             "--redis-url", redis_server.url, "--prefill", "1", "--decode", "1",
             "--max-num-seqs", "7", "--block-size", "8", "--kv-cache-dtype", "fp8",
             "--max-model-len", "256", "--decode-max-model-len", "96",
             "--prefill-num-kv-blocks", "60", "--decode-num-kv-blocks", "40"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    registry = Registry(redis_server.url)
    try:
        deadline = time.monotonic() + 240
        while "press Ctrl-C" not in log.read_text():
            assert up.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        address = log.read_text().split("serving on ", 1)[1].split()[0]

        (prefill,) = registry.live_workers("prefill")
        (decode,) = registry.live_workers("decode")
        for worker in (prefill, decode):  # the general flags
            assert (worker.max_num_seqs, worker.block_size) == (7, 8), worker
            assert worker.kv_dtype == "float8_e4m3fn", worker
        assert (prefill.max_model_len, prefill.num_total_blocks) == (256, 60)
        assert (decode.max_model_len, decode.num_total_blocks) == (96, 40)  # its own, over 256

        channel, stub = connect(address)
        with channel:
            info = stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=30)
            assert info.block_size == 8  # the gateway's too: it routes to these workers
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            done = collect(stream(stub, "Once upon a time", params, timeout_s=120))
        assert len(done.token_ids[0]) == 8
    finally:
        registry.close()
        up.send_signal(signal.SIGINT)
        up.wait(90)
    assert up.returncode == 0, log.read_text()
    assert "stopped" in log.read_text()
