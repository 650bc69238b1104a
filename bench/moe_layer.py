"""One Mixture-of-Experts layer: kernels/fused_moe.py against a per-expert torch loop and the
device's copy bandwidth, in the same run.

    python -m bench.moe_layer [--tokens 1,64,4096] [--layers 4] [--out F]
    python -m bench.moe_layer --quick     # a tiny shape; on a CPU in Triton's interpreter

The Qwen3-30B-A3B MoE shape (H 2048, I 768, E 128, k 8), bf16, random weights; the router is
random logits -> softmax -> top-k, renormalised (Qwen3-MoE's norm_topk_prob), a fresh draw per
layer. For each token count T:

- experts touched (mean over the layers) against the expectation E * (1 - (1 - k / E)^T) under
  uniform routing, and the bytes of their weights (each touched expert's w13 and w2);
- the fused path, timed from CUDA-graph replays of one call per layer over `--layers` layers'
  own weights (~1.2 GB each, so no layer finds its experts in the 50 MB L2): time per layer,
  touched bytes / time as TB/s, and its share of the copy bandwidth; TFLOP/s (2 * T * k * 3HI);
- the baselines: `fused_moe_ref` (HF's loop over the experts with tokens, eager; L2 flushed
  before each run by triton's do_bench) and the copy bandwidth of a 2 GB device-to-device copy
  (bytes read + written, as bench/gemv.py counts it).

Writes JSON with the device, shape, dtype, each T's tile config and the rows.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from bench.common import device_name, expected_experts, table, write_results

QWEN3_30B_A3B = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}
TINY = {"hidden": 64, "inter": 48, "experts": 8, "top_k": 2}


def route(
    num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits -> softmax (float32) -> top-k, renormalised: (ids int64, weights float32)."""
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(device)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return ids.contiguous(), (weights / weights.sum(dim=-1, keepdim=True)).contiguous()


def build_layers(
    shape: dict[str, int], layers: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (w13 [E, 2I, H], w2 [E, H, I]), scaled so activations stay O(1)."""
    h, i, e = shape["hidden"], shape["inter"], shape["experts"]
    out = []
    for _ in range(layers):
        w13 = torch.empty(e, 2 * i, h, device=device, dtype=dtype).normal_(0, h**-0.5)
        w2 = torch.empty(e, h, i, device=device, dtype=dtype).normal_(0, i**-0.5)
        out.append((w13, w2))
    return out


def bench_tokens(
    num_tokens: int,
    shape: dict[str, int],
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
    copy_gb_per_s: float,
    pdl: bool = False,
) -> dict[str, Any]:
    from bench.kernels import time_graph_us, time_us
    from splitserve.kernels.fused_moe import fused_moe, pick_config
    from splitserve.kernels.moe_ref import fused_moe_ref

    h, i, e, k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, h, generator=gen).to(device, dtype)
    routes = [route(num_tokens, e, k, gen, device) for _ in layers]
    touched = sum(len(set(ids.flatten().tolist())) for ids, _ in routes) / len(routes)
    expected = expected_experts(e, k, num_tokens)
    expert_bytes = 3 * h * i * layers[0][0].element_size()
    touched_bytes = touched * expert_bytes

    (w13, w2), (ids, weights) = layers[0], routes[0]
    got = fused_moe(x, w13, w2, ids, weights)  # compiles outside the graph
    want = fused_moe_ref(x, w13, w2, ids, weights)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)

    calls: list[Callable[[], object]] = [
        partial(fused_moe, x, *lw, *r, pdl=pdl) for lw, r in zip(layers, routes, strict=True)
    ]
    fused_us = time_graph_us(calls, device)
    loop_us = time_us(lambda: fused_moe_ref(x, w13, w2, ids, weights), device)
    config = pick_config(num_tokens, k, e, h, i, dtype)
    g, d = config.gate_up, config.down
    tb_per_s = touched_bytes / fused_us / 1e6
    return {
        "T": num_tokens,
        "experts": touched,
        "expected": expected,
        "weights MB": touched_bytes / 1e6,
        "fused us": fused_us,
        "TB/s": tb_per_s,
        "% of copy": 100 * tb_per_s * 1e3 / copy_gb_per_s,
        "TFLOP/s": 2 * num_tokens * k * 3 * h * i / fused_us / 1e6,
        "loop us": loop_us,
        "speedup": loop_us / fused_us,
        "tiles": f"M{config.block_m} gu {g.block_n}x{g.block_k}/{g.num_warps}w{g.num_stages}s "
        f"dn {d.block_n}x{d.block_k}/{d.num_warps}w{d.num_stages}s",
    }


def sweep_tokens(
    num_tokens: int,
    shape: dict[str, int],
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
) -> list[dict[str, Any]]:
    """Tile configs around `pick_config`'s for one T (gate/up's tiles first, then down's with
    the best gate/up; PDL off and on): each one's time per layer, best first."""
    from bench.kernels import time_graph_us
    from splitserve.kernels.fused_moe import fused_moe, pick_config
    from splitserve.kernels.moe_ref import GemmTiles, MoeConfig

    h, i, e, k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, h, generator=gen).to(device, dtype)
    routes = [route(num_tokens, e, k, gen, device) for _ in layers]
    base = pick_config(num_tokens, k, e, h, i, dtype)
    decode = base.block_m == 16
    if decode:  # memory-bound: how wide and deep a program streams
        shapes = [
            GemmTiles(n, kk, w, st)
            for n in (32, 64, 128) for kk in (128, 256) for w in (2, 4, 8) for st in (2, 3, 4)
        ]  # fmt: skip
    else:  # tensor-core tiles
        shapes = [
            GemmTiles(n, kk, w, st)
            for n in (64, 128, 256) for kk in (32, 64, 128) for w in (4, 8) for st in (3, 4, 5)
        ]  # fmt: skip
    rows: list[dict[str, Any]] = []

    def timed(config: MoeConfig, pdl: bool) -> float:
        calls = [
            partial(fused_moe, x, *lw, *r, config=config, pdl=pdl)
            for lw, r in zip(layers, routes, strict=True)
        ]
        try:
            calls[0]()
            us = time_graph_us(calls, device)
        except Exception as exc:  # a config past the shared memory: recorded, not fatal
            us = float("inf")
            print(f"T={num_tokens} {config}: {type(exc).__name__}")
        g, d = config.gate_up, config.down
        rows.append(
            {
                "T": num_tokens,
                "us": us,
                "pdl": pdl,
                "tiles": f"M{config.block_m} gu {g.block_n}x{g.block_k}/{g.num_warps}w"
                f"{g.num_stages}s dn {d.block_n}x{d.block_k}/{d.num_warps}w{d.num_stages}s",
            }
        )
        return us

    block_ms = (16,) if decode else (64, 128)
    best_m, best_gu, best_dn = base.block_m, base.gate_up, base.down
    best = timed(base, False)
    for m in block_ms:
        for gu in shapes:
            if gu.block_n > i or MoeConfig(m, gu, best_dn) == base:
                continue
            us = timed(MoeConfig(m, gu, best_dn), False)
            if us < best:
                best, best_m, best_gu = us, m, gu
    for dn in shapes:
        us = timed(MoeConfig(best_m, best_gu, dn), False)
        if us < best:
            best, best_dn = us, dn
    timed(MoeConfig(best_m, best_gu, best_dn), True)
    return sorted(rows, key=lambda r: r["us"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,64,4096", help="token counts T")
    parser.add_argument("--layers", type=int, default=4, help="layers of weights to rotate over")
    parser.add_argument("--out", default="bench/results/moe_layer.json")
    parser.add_argument("--quick", action="store_true", help="tiny shape (CPU: interpreter)")
    parser.add_argument(
        "--sweep", action="store_true", help="time tile configs around the default per T"
    )
    parser.add_argument("--pdl", action="store_true", help="programmatic dependent launch")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    if args.quick:
        if not gpu:
            # NOTE: before any Triton kernel is defined (the kernels bind to it then).
            os.environ.setdefault("TRITON_INTERPRET", "1")
        shape, tokens, num_layers, copy_bytes = TINY, [1, 4, 32], 2, 4 << 20
    else:
        assert gpu, "this benchmark needs a GPU (or --quick)"
        shape, num_layers, copy_bytes = QWEN3_30B_A3B, args.layers, 2 << 30
        tokens = [int(t) for t in args.tokens.split(",")]
    from bench.kernels import copy_bandwidth

    device = torch.device("cuda" if gpu else "cpu")
    # bf16 on a GPU; Triton's interpreter mishandles bf16 dots, so float32 there.
    dtype = torch.bfloat16 if gpu else torch.float32
    copy = copy_bandwidth(copy_bytes, device)
    with torch.inference_mode():
        layers = build_layers(shape, num_layers, dtype, device)
        if args.sweep:
            swept = {t: sweep_tokens(t, shape, layers, dtype, device) for t in tokens}
            for t, found in swept.items():
                print(f"T={t}: {len(found)} configs, best first")
                print(table(found[:8], ["us", "pdl", "tiles"]))
            write_results(args.out, {"benchmark": "moe_layer_sweep", "rows": swept})
            return {"rows": swept}
        rows = [
            bench_tokens(t, shape, layers, dtype, device, copy["GB_per_s"], args.pdl)
            for t in tokens
        ]
    name = "tiny (quick)" if args.quick else "Qwen3-30B-A3B MoE"
    print(
        f"{device_name()}, {name} layer (H {shape['hidden']}, I {shape['inter']}, E "
        f"{shape['experts']}, k {shape['top_k']}), {str(dtype).removeprefix('torch.')}, "
        f"{num_layers} layers' weights rotated; copy bandwidth {copy['GB_per_s'] / 1e3:.2f} TB/s"
    )
    columns = ["T", "experts", "expected", "weights MB", "fused us", "TB/s", "% of copy"]
    columns += ["TFLOP/s", "loop us", "speedup", "tiles"]
    print(table(rows, columns))
    result = {
        "benchmark": "moe_layer",
        "device": device_name(),
        "shape": "tiny" if args.quick else "qwen3-30b-a3b",
        **shape,
        "dtype": str(dtype),
        "layers": num_layers,
        "pdl": args.pdl,
        "router": "random logits, softmax, top-k, renormalised; a fresh draw per layer",
        "method": "fused: median of CUDA-graph replays over the layers (per layer); loop: "
        "triton do_bench (L2 flushed); TB/s = touched expert weight bytes / fused time",
        "copy_bandwidth": {**copy, "TB_per_s": copy["GB_per_s"] / 1e3},
        "rows": rows,
    }
    write_results(args.out, result)
    return result


if __name__ == "__main__":
    main()
