"""Paged decode attention over an FP8 KV cache against the same context in bf16.

    python -m bench.fp8_kv_attention [--out F]     (GPU; Llama-3-8B heads: 32 q / 8 KV, head 128)

Each (batch, context) is timed over a bf16 cache (the baseline) and an FP8 (e4m3) cache, under
the kernel's launch config and the other candidate (BLOCK_N, num_warps, num_stages, dots) tiles,
as the engine runs it: CUDA-graph replays over disjoint page sets beyond L2. "dots" is the
dtype the FP8 keys and values widen to for the dot products: bf16 (q's dtype) or fp16 (one
conversion instruction per pair on Hopper; the query rows scaled by a power of two). The FP8
rows' outputs are checked against the default config's first. Picks `_launch_config`'s FP8
tiles.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

import splitserve.kernels.decode_attention as attention
from bench.common import device_name, table, write_results
from bench.kernels import FULL, copies_beyond_l2, random_paged_cache, shuffled_tables, time_graph_us

CANDIDATES = [
    (128, 4, 3, False), (64, 4, 2, True), (128, 4, 2, True), (128, 8, 2, True),
    (128, 4, 3, True), (64, 4, 3, True), (128, 8, 3, True),
]  # fmt: skip


def _name(config) -> str:
    block_n, warps, stages, f16 = config
    return f"{block_n}x{warps}x{stages} {'f16' if f16 else 'bf16'}"
CASES = [(8, 1024), (8, 4096), (64, 1024), (64, 4096), (256, 1024), (256, 4096)]


def time_case(batch: int, context: int, dtype: torch.dtype, config) -> tuple[float, torch.Tensor]:
    device = torch.device("cuda")
    torch.manual_seed(batch + context)  # NOTE: the same cache and query under every config
    shapes, elem = FULL, torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * context * shapes.num_kv_heads * shapes.head_dim * elem
    copies = copies_beyond_l2(kv_bytes, device)
    per_seq = context // shapes.block_size
    cache = random_paged_cache(copies * batch * per_seq, shapes, torch.bfloat16, device, "block")
    cache = cache.to(dtype)
    tables = shuffled_tables(copies * batch, per_seq, device).view(copies, batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, shapes.num_heads, shapes.head_dim, device=device, dtype=torch.bfloat16)
    scale = shapes.head_dim**-0.5
    default = attention._launch_config
    try:
        if config is not None:
            attention._launch_config = lambda dtype, cache_dtype=None: config
        first = attention.decode_attention(q, cache, tables[0], lens, scale)
        out = torch.empty_like(q)
        calls = [
            partial(attention.decode_attention, q, cache, tables[i], lens, scale, out=out)
            for i in range(copies)
        ]
        return time_graph_us(calls, device), first
    finally:
        attention._launch_config = default


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/fp8_kv_attention.json")
    args = parser.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    rows = []
    for batch, context in CASES:
        bf16_us, _ = time_case(batch, context, torch.bfloat16, None)
        fp8_us, want = time_case(batch, context, torch.float8_e4m3fn, None)
        row = {"batch": batch, "context": context, "bf16 us": bf16_us, "fp8 us": fp8_us}
        row["fp8 speed-up"] = bf16_us / fp8_us
        for config in CANDIDATES:
            us, got = time_case(batch, context, torch.float8_e4m3fn, config)
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            row[_name(config)] = us
        rows.append(row)
        torch.cuda.empty_cache()
    picked = attention._launch_config(torch.bfloat16, torch.float8_e4m3fn)
    results = {
        "benchmark": "fp8_kv_attention",
        "device": device_name(),
        "heads": {"q": FULL.num_heads, "kv": FULL.num_kv_heads, "dim": FULL.head_dim},
        "fp8_launch_config": _name(picked),
        "timing": "us per call, CUDA-graph replays over disjoint page sets beyond L2",
        "rows": rows,
    }
    write_results(args.out, results)
    print(f"{device_name()}: FP8 cache tiles {_name(picked)} (BLOCK_N x warps x stages, dots);"
          " us per call")
    print(table(rows, list(rows[0])))
    return results


if __name__ == "__main__":
    main()
