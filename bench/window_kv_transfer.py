"""KV bytes one P/D push moves when sliding layers keep their KV in a window pool, against
keeping every block for every layer (docs/engine.md, "Sliding-window KV").

A real stack on this machine (redis-server, gateway, one prefill and one decode worker, KV over
`--kv-transport`) serves one prompt of each `--contexts` length on a tiny random-weight
checkpoint with Gemma-3-270M's layer layout (18 layers, every 6th full, window 512; narrow:
2 KV heads of 32, float32, so a CPU prefills 32k tokens in minutes). The bytes come from the
decode worker's `kv_bytes_received`; the layout predicts `3/18 + 15/18 x window blocks /
blocks`, the window blocks being those the last prompt token's query sees.

    python -m bench.window_kv_transfer                          # 4,096 and 32,704 tokens
    python -m bench.window_kv_transfer --contexts 1024          # a smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import grpc

from bench.common import device_name, table, write_results
from splitserve.client import collect, stream
from splitserve.engine import SamplingParams
from splitserve.kv_transfer.registry import Registry
from splitserve.launch.up import StackSettings, start_stack
from splitserve.protos.v1 import gateway_pb2_grpc, worker_pb2, worker_pb2_grpc

BLOCK, WINDOW, LAYERS = 16, 512, (["sliding_attention"] * 5 + ["full_attention"]) * 3


def _checkpoint(root: Path) -> Path:
    from splitserve.testing.tiny_families import make_tiny_family_model

    overrides = {"num_hidden_layers": len(LAYERS), "layer_types": LAYERS,
                 "sliding_window": WINDOW, "max_position_embeddings": 40960}  # fmt: skip
    return make_tiny_family_model(root / "gemma3-270m-layout", "gemma3", config_overrides=overrides)


def _received(redis_url: str) -> int:
    registry = Registry(redis_url)
    try:
        (decode,) = registry.live_workers("decode")
    finally:
        registry.close()
    with grpc.insecure_channel(decode.address) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        return int(stub.GetStats(worker_pb2.GetStatsRequest(), timeout=10).kv_bytes_received)


def _predicted(model: Path, prompt_len: int) -> tuple[int, int]:
    """(window-pool bytes, every-block bytes) of a push of `prompt_len` tokens, from the shape."""
    config = json.loads((model / "config.json").read_text())
    page = 2 * BLOCK * config["num_key_value_heads"] * config["head_dim"] * 4
    blocks, full = -(-prompt_len // BLOCK), LAYERS.count("full_attention")
    seen = blocks - max(0, (prompt_len - 1 - WINDOW + 1) // BLOCK)
    return (blocks * full + seen * (len(LAYERS) - full)) * page, blocks * len(LAYERS) * page


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32704])
    parser.add_argument("--kv-transport", default="nixl")
    parser.add_argument("--out", default="bench/results/window_kv_transfer.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = _checkpoint(Path(tmp))
        most = max(args.contexts) + 64
        worker_args = (
            "--kv-transport", args.kv_transport, "--block-size", str(BLOCK),
            "--num-kv-blocks", str(-(-most // BLOCK) + 64), "--max-model-len", str(most),
            "--max-num-batched-tokens", "512", "--lease-s", "600", "--engine-stall-s", "600",
            "--heartbeat-ttl-s", "120",
        )  # fmt: skip
        stack = start_stack(StackSettings(model=str(model), prefill=1, decode=1,
                                          extra_worker_args=worker_args))  # fmt: skip
        try:
            gateway = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(stack.address))
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            for n in args.contexts:
                rng = random.Random(n)  # NOTE: unrelated prompts: no prefix hit on either side
                prompt = [rng.randrange(50, 450) for _ in range(n)]
                before, start = _received(stack.redis_url), time.perf_counter()
                collect(stream(gateway, prompt, params, timeout_s=3600))
                moved = _received(stack.redis_url) - before
                window, every = _predicted(model, n)
                rows.append({
                    "prompt": n, "bytes moved": moved, "every block": every,
                    "ratio": round(moved / every, 4), "predicted": window,
                    "seconds": round(time.perf_counter() - start, 1),
                })  # fmt: skip
        finally:
            stack.stop()
    print(table(rows, list(rows[0])))
    write_results(args.out, {"device": device_name(), "transport": args.kv_transport, "rows": rows})


if __name__ == "__main__":
    main()
