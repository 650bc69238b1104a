"""What the LoRA kernels add to a decode step, kernels only: every layer's base projections
(q/k/v, o, gate/up, down GEMMs) with and without each group's shrink + expand, in one CUDA graph
per configuration, as the engine's decode graphs run them; and the same with the per-row
kernels they replaced (bench/lora_bgmv.py), in the same run.

    python -m bench.lora_kernels [--shape llama-3-8b] [--batch 64] [--adapters 1,8,32]
        [--rank 16] [--reps 20] [--out bench/results/lora_kernels.json]
    python -m bench.lora_kernels --smoke    # the CPU (Triton's interpreter), a tiny shape

Row i runs adapter i mod N; the rows reach the kernels grouped by adapter and cut into tiles
of at most TILE_ROWS (`group_rows`), in a segment buffer of the decode graphs' capacity (unused
segments skipped), with `max_loras` = the largest N. Every layer has its own weights and
adapter slots, so the L2 cache holds no more than in a real step. Prints the base graph's ms,
each configuration's ms and the difference (the LoRA kernels' cost per step, 256 launches on
32 layers), for the grouped kernels and for the per-row ones (one segment per row), and writes
JSON. bench/lora.py measures the whole engine.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import torch

from bench.common import SHAPES, device_name, sync, table, write_results


def _layer_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each projection group: (in features, output slices)."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim", hidden // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {
        "qkv": (hidden, (q, kv, kv)),
        "o": (q, (hidden,)),
        "gate_up": (hidden, (inter, inter)),
        "down": (inter, (hidden,)),
    }


def _rand(*shape: int, device: str, dtype: torch.dtype, std: float) -> torch.Tensor:
    return torch.empty(shape, device=device, dtype=dtype).normal_(0, std)


def build(cfg: dict[str, Any], layers: int, slots: int, rank: int, batch: int, device: str,
          dtype: torch.dtype) -> list[dict[str, Any]]:  # fmt: skip
    """Per layer and group: input x, base weight W, adapter A [slots, RA, K], B [slots, N, R],
    output y."""
    out = []
    for _ in range(layers):
        layer = {}
        for name, (k, slices) in _layer_shapes(cfg).items():
            n = sum(slices)
            layer[name] = {
                "x": _rand(batch, k, device=device, dtype=dtype, std=1.0),
                "w": _rand(n, k, device=device, dtype=dtype, std=k**-0.5),
                "a": _rand(slots, rank * len(slices), k, device=device, dtype=dtype, std=k**-0.5),
                "b": _rand(slots, n, rank, device=device, dtype=dtype, std=0.01),
                "y": torch.empty(batch, n, device=device, dtype=dtype),
                "slices": slices,
            }
        out.append(layer)
    return out


def step(
    layers: list[dict[str, Any]], lora: Any | None, scales: torch.Tensor, pdl: bool, kind: str
) -> None:
    """One decode step's projections; `lora` = (segments, max_seg_len, rows) or None (base).
    `kind`: "grouped" (kernels/lora.py) or "per-row" (bench/lora_bgmv.py)."""
    from bench.lora_bgmv import bgmv_expand, bgmv_shrink
    from splitserve.kernels.lora import lora_expand, lora_shrink

    for layer in layers:
        for group in layer.values():
            torch.matmul(group["x"], group["w"].t(), out=group["y"])
            if lora is None:
                continue
            segments, max_len, rows = lora
            if kind == "per-row":
                s = bgmv_shrink(group["x"], group["a"], segments)
                bgmv_expand(group["y"], s, group["b"], scales, segments, group["slices"])
                continue
            s = lora_shrink(group["x"], group["a"], segments, max_len, rows, pdl=pdl)
            lora_expand(group["y"], s, group["b"], scales, segments, max_len,
                        group["slices"], rows, pdl=pdl)  # fmt: skip


def per_row_inputs(batch: int, adapters: int, device: str) -> tuple:
    """The replaced kernels' inputs: one segment (row, 1, slot) per row."""
    rows = torch.arange(batch, dtype=torch.int32)
    segments = torch.stack([rows, torch.ones_like(rows), rows % adapters])
    return segments.to(device), 1, None


def lora_inputs(batch: int, adapters: int, max_loras: int, device: str) -> tuple:
    """The decode graphs' LoRA inputs for rows i -> slot i mod `adapters`."""
    from splitserve.engine.lora.batch import group_rows, tile_capacity
    from splitserve.kernels.lora_ref import TILE_ROWS

    cap = tile_capacity(batch, max_loras, TILE_ROWS)
    segments, rows = group_rows(np.arange(batch) % adapters, TILE_ROWS)
    padded = np.zeros((3, cap), dtype=np.int32)
    padded[2] = -1
    padded[:, : segments.shape[1]] = segments
    return (
        torch.from_numpy(padded).to(device),
        TILE_ROWS,
        torch.from_numpy(rows).to(device),
    )


def time_step(fn: Any, reps: int, graphs: bool) -> float:
    """Median seconds of one replay of `fn` captured in a CUDA graph (eager on the CPU)."""
    fn()  # compile / warm up
    if graphs:
        sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        fn = graph.replay
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--adapters", default="1,8,32")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-pdl", action="store_true", help="launch the LoRA kernels plainly")
    parser.add_argument("--skip-per-row", action="store_true", help="not the replaced kernels")
    parser.add_argument("--out", default="bench/results/lora_kernels.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU")
    args = parser.parse_args()
    counts = [int(n) for n in args.adapters.split(",")]
    cfg = SHAPES[args.shape]
    layers = cfg["num_hidden_layers"]
    if args.smoke:
        # NOTE: before any Triton kernel is defined (the kernels bind to it then).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        cfg = {**cfg, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
               "num_key_value_heads": 2}  # fmt: skip
        layers, args.batch, args.reps, counts = 1, 8, 1, [1, 2]
        device, dtype, graphs = "cpu", torch.float32, False
    else:
        assert torch.cuda.is_available(), "this benchmark needs a GPU (or --smoke)"
        device, dtype, graphs = "cuda", torch.bfloat16, True
    max_loras = max(counts)
    with torch.inference_mode():
        weights = build(cfg, layers, max_loras, args.rank, args.batch, device, dtype)
        scales = torch.full((max_loras,), 2.0, device=device)
        pdl = not args.no_pdl
        base = time_step(lambda: step(weights, None, scales, pdl, ""), args.reps, graphs)
        rows: list[dict[str, Any]] = [{"adapters": "base", "step ms": base * 1e3}]
        for n in counts:
            for kind in ("grouped", "per-row"):
                if kind == "per-row" and args.skip_per_row:
                    continue
                if kind == "grouped":
                    lora = lora_inputs(args.batch, n, max_loras, device)
                else:
                    lora = per_row_inputs(args.batch, n, device)
                seconds = time_step(
                    lambda lora=lora, kind=kind: step(weights, lora, scales, pdl, kind),
                    args.reps,
                    graphs,
                )
                rows.append(
                    {
                        "adapters": n,
                        "kernels": kind,
                        "step ms": seconds * 1e3,
                        "LoRA ms": (seconds - base) * 1e3,
                        "LoRA us/layer": (seconds - base) * 1e6 / layers,
                    }
                )
    print(
        f"{device_name()}, {'tiny (smoke)' if args.smoke else args.shape} projections x {layers} "
        f"layers, {str(dtype).removeprefix('torch.')}, batch {args.batch}, rank {args.rank}, "
        f"max_loras {max_loras}, PDL {'on (Hopper and newer)' if pdl else 'off'}, "
        f"{'CUDA graph' if graphs else 'eager'}"
    )
    print(table(rows, ["adapters", "kernels", "step ms", "LoRA ms", "LoRA us/layer"]))
    write_results(
        args.out,
        {
            "device": device_name(),
            "shape": "tiny" if args.smoke else args.shape,
            "layers": layers,
            "dtype": str(dtype),
            "batch": args.batch,
            "rank": args.rank,
            "max_loras": max_loras,
            "pdl": pdl,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
