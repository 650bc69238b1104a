"""Batch-1 decode projections: kernels/gemv.py against cuBLAS (F.linear).

    python -m bench.gemv [--sweep] [--fp8] [--out F]

Every projection of the Llama-3-8B and Qwen3-0.6B shapes, bf16, timed from CUDA-graph replays
over disjoint weight copies totalling >= 2x L2 (as in a model, where no layer finds its weights
in L2); GB/s counts the weight, input and output bytes. Back-to-back calls overlap through
programmatic dependent launch (kernels/pdl.py); "no-PDL" times the same kernel without it.
"down+silu" times the SwiGLU activation kernel and then the down projection; "gate_up+silu" the
gate/up projection with SwiGLU fused behind it (`gemv(swiglu=True)`, as the MLP runs at batch 1),
against cuBLAS then the activation kernel, and "unfused us" the plain GEMV then that kernel.
`--sweep` times every candidate tile config and reports the best one per shape. `--fp8` times
the kernel on FP8 (e4m3) weights with per-channel scales (engine/quantization.py) against the
same bf16 cuBLAS baseline; its GB/s count one byte per weight.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.common import SHAPES, device_name, table, write_results
from bench.kernels import copies_beyond_l2, copy_bandwidth, time_graph_us

CANDIDATES = [(8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 4), (16, 1024, 8), (32, 256, 4)]
FP8_CANDIDATES = [
    (8, 1024, 4), (8, 2048, 8), (16, 512, 4), (16, 1024, 4), (16, 1024, 8), (16, 2048, 8),
    (32, 512, 4), (32, 1024, 8), (64, 256, 4), (4, 2048, 4),
]  # fmt: skip


def projections(shape: str) -> list[tuple[str, int, int, str | None]]:
    cfg = SHAPES[shape]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head = cfg.get("head_dim", hidden // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    return [
        ("qkv", q + 2 * kv, hidden, None),
        ("o", hidden, q, None),
        ("gate_up", 2 * inter, hidden, None),
        ("gate_up+silu", 2 * inter, hidden, "swiglu"),
        ("down", hidden, inter, None),
        ("down+silu", hidden, inter, "silu_and_mul"),
        ("lm_head", cfg["vocab_size"], hidden, None),
    ]


def bench_one(
    n: int, k: int, activation: str | None, sweep: bool, device: torch.device, fp8: bool = False
) -> dict:
    from splitserve.engine.quantization import quantize_weight
    from splitserve.kernels.activation import silu_and_mul
    from splitserve.kernels.gemv import gemv, pick_config

    dtype = torch.bfloat16
    copies = copies_beyond_l2(n * k * 2, device)
    weights = [torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for _ in range(copies)]
    quantized = [quantize_weight(w) for w in weights] if fp8 else []
    swiglu = activation == "swiglu"
    width = 2 * k if activation == "silu_and_mul" else k
    width_out = n // 2 if swiglu else n
    x = torch.randn(1, width, device=device, dtype=dtype)
    out = torch.empty(1, width_out, device=device, dtype=dtype)
    moved = n * k * (1 if fp8 else 2) + (width + width_out) * 2

    act = torch.empty(1, k, device=device, dtype=dtype)
    gate_up = torch.empty(1, n, device=device, dtype=dtype)

    def cublas(w: torch.Tensor) -> Callable[[], object]:
        if swiglu:
            return lambda: silu_and_mul(torch.matmul(x, w.t(), out=gate_up), out=out)
        if activation:
            return lambda: torch.matmul(silu_and_mul(x, out=act), w.t(), out=out)
        return lambda: torch.matmul(x, w.t(), out=out)

    def ours(i: int, config: tuple[int, int, int], pdl: bool = True) -> Callable[[], object]:
        w, scale = quantized[i] if fp8 else (weights[i], None)
        if swiglu:
            return lambda: gemv(
                x, w, weight_scale=scale, out=out, config=config, swiglu=True, pdl=pdl
            )
        if activation:
            return lambda: gemv(
                silu_and_mul(x, out=act, pdl=pdl),
                w,
                weight_scale=scale,
                out=out,
                config=config,
                pdl=pdl,
            )
        return lambda: gemv(x, w, weight_scale=scale, out=out, config=config, pdl=pdl)

    def unfused(i: int) -> Callable[[], object]:
        w, scale = quantized[i] if fp8 else (weights[i], None)
        return lambda: silu_and_mul(
            gemv(x, w, weight_scale=scale, out=gate_up, pdl=True), out=out, pdl=True
        )

    if swiglu:
        want = silu_and_mul(F.linear(x, weights[0])).float()
    else:
        want = F.linear(silu_and_mul(x) if activation else x, weights[0]).float()
    ours(0, pick_config(n, k, fp8, swiglu))()
    torch.testing.assert_close(out.float(), want, atol=0.05 * (1 + 3 * fp8), rtol=0.02)

    cublas_us = time_graph_us([cublas(w) for w in weights], device)
    configs = [pick_config(n, k, fp8, swiglu)]
    if sweep:
        configs += [c for c in (FP8_CANDIDATES if fp8 else CANDIDATES) if c not in configs]
    mine = range(len(weights))
    timed = [(time_graph_us([ours(i, c) for i in mine], device), c) for c in configs]
    picked_us = timed[0][0]
    no_pdl_us = time_graph_us([ours(i, configs[0], pdl=False) for i in mine], device)
    best_us, best = min(timed)
    mine_unfused = [unfused(i) for i in mine] if swiglu else []
    return {
        "unfused us": time_graph_us(mine_unfused, device) if swiglu else None,
        "N": n,
        "K": k,
        "cuBLAS us": cublas_us,
        "gemv us": picked_us,
        "no-PDL us": no_pdl_us,
        "speedup": cublas_us / picked_us,
        "cuBLAS GB/s": moved / cublas_us / 1e3,
        "gemv GB/s": moved / picked_us / 1e3,
        "best us": best_us,
        "best config": "x".join(map(str, best)),
        "sweep us": {"x".join(map(str, c)): us for us, c in timed},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other tile configs")
    parser.add_argument("--fp8", action="store_true", help="FP8 weights (Llama-3-8B shape)")
    parser.add_argument("--out", default="bench/results/gemv.json")
    args = parser.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    device = torch.device("cuda")
    copy = copy_bandwidth(2 << 30, device)
    rows = []
    for shape in ("llama-3-8b",) if args.fp8 else ("llama-3-8b", "qwen3-0.6b"):
        for name, n, k, activation in projections(shape):
            if args.fp8 and name == "lm_head":
                continue  # the LM head stays bf16
            row = {"shape": shape, "proj": name}
            row.update(bench_one(n, k, activation, args.sweep, device, args.fp8))
            row["% of copy"] = 100 * row["gemv GB/s"] / copy["GB_per_s"]
            rows.append(row)
            print(row, flush=True)
    result = {
        "benchmark": "gemv",
        "device": device_name(),
        "dtype": "bfloat16",
        "weights": "fp8" if args.fp8 else "bfloat16",
        "copy_bandwidth": copy,
        "method": "median of CUDA-graph replays over disjoint weight copies >= 2x L2",
        "rows": rows,
    }
    write_results(args.out, result)
    print(f"device: {device_name()}  copy bandwidth {copy['GB_per_s']:.0f} GB/s")
    columns = ["shape", "proj", "N", "K", "cuBLAS us", "gemv us", "unfused us", "no-PDL us"]
    columns += ["speedup"]
    columns += ["gemv GB/s", "% of copy", "best us", "best config"]
    print(table(rows, columns))
    return result


if __name__ == "__main__":
    main()
