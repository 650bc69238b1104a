"""FP8 projections: what the engine runs for 2-256 rows (and prefill-sized M) against bf16 cuBLAS.

    python -m bench.fp8_gemm [--rows 2,8,...] [--sweep] [--out F]

For each Llama-3-8B projection and row count M, three FP8 paths against `F.linear` on the bf16
weight: "scaled_mm" (per-token activation quantization, kernels/fp8_quant.py, then rowwise
`torch._scaled_mm`), "skinny" (kernels/fp8_skinny.py, its picked tiles) and "engine" (what
`TritonOps.linear` runs at that M: skinny up to `MAX_ROWS` rows, scaled_mm above). Timed from
CUDA-graph replays over disjoint weight copies totalling >= 2x L2, as in bench/gemv.py. "% of
copy" is the weight bytes (one per FP8 weight, two per bf16 one) over the time, against the
device copy bandwidth of the same run: a memory-bound matmul at these sizes should sit near it.
Beyond 256 rows the skinny kernel is not timed, and at prefill sizes (`--rows 8192`) the
TFLOP/s columns are the figure to read.
Summed over a layer's four projections x 32 layers, the last table is what the matmuls cost
per decode step. `--sweep` also times every candidate tile of the skinny kernel, with row tiles
of up to 64 rows and (beyond 64 rows) of 128.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from bench.common import SHAPES, device_name, table, write_results
from bench.gemv import projections
from bench.kernels import copies_beyond_l2, copy_bandwidth, time_graph_us

# (BLOCK_N, BLOCK_K, programs the K split aims for, num_warps, num_stages) for a row tile of
# BLOCK_M rows. BLOCK_M follows the rows up to 64 (kernels/fp8_skinny.py); beyond 64 rows the
# sweep tries 64, 128 and 256-row tiles, with fewer splits and stages (more MMA work per
# program, more shared memory per stage).
SKINNY_ROWS = 256  # the skinny kernel is timed up to this many rows


def candidates(block_m: int) -> list[tuple[int, int, int, int, int]]:
    programs, stages = ((256, 512), (3, 4)) if block_m <= 64 else ((128, 256), (3,))
    tiles = [
        (n, k, p, 4, s) for n in (64, 128) for k in (128, 256) for p in programs for s in stages
    ]
    if block_m > 64:  # two warpgroups for the largest accumulators
        tiles += [(128, k, p, 8, 3) for k in (128, 256) for p in programs]
    return tiles


def row_tiles(rows: int) -> list[int]:
    """The row-tile heights the sweep tries for `rows` rows."""
    rows_pow2 = max(16, triton.next_power_of_2(rows))
    if rows_pow2 <= 64:
        return [rows_pow2]
    return [m for m in (64, 128, 256) if m <= rows_pow2 and 2 * m > rows_pow2 // 2]


def bench_one(n: int, k: int, rows: int, sweep: bool, device: torch.device) -> dict:
    from splitserve.engine.ops import TritonOps, fp8_scaled_mm
    from splitserve.engine.quantization import quantize_weight
    from splitserve.kernels.fp8_quant import quantize_rows
    from splitserve.kernels.fp8_skinny import pick_config, skinny_fp8_gemm, split_for

    ops = TritonOps(pdl=True)
    copies = copies_beyond_l2(n * k * 2, device)
    weights = [
        torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)
    ]
    quantized = [quantize_weight(w) for w in weights]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)

    def scaled_mm(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows(x, pdl=True)
        return fp8_scaled_mm(xq, xs, q, s, None, x.dtype)

    def skinny_call(q: torch.Tensor, s: torch.Tensor, config: tuple[int, ...]) -> torch.Tensor:
        xq, xs = quantize_rows(x, pdl=True)
        return skinny_fp8_gemm(xq, xs, q, s, config=config, pdl=True)  # type: ignore[arg-type]

    def skinny(config: tuple[int, ...]) -> float:
        calls = [lambda q=q, s=s: skinny_call(q, s, config) for q, s in quantized]
        calls[0]()  # NOTE: compile (or fail on too little shared memory) outside the graph
        return time_graph_us(calls, device)

    picked = pick_config(rows, n, k)
    result = {
        "bf16_us": time_graph_us([lambda w=w: F.linear(x, w) for w in weights], device),
        "scaled_mm_us": time_graph_us(
            [lambda q=q, s=s: scaled_mm(q, s) for q, s in quantized], device
        ),
        "skinny_us": skinny(picked) if rows <= SKINNY_ROWS else None,
        "engine_us": time_graph_us(
            [lambda q=q, s=s: ops.linear(x, q, weight_scale=s) for q, s in quantized], device
        ),
        "picked": "x".join(map(str, picked)),
    }
    if sweep:
        timed = {}
        for block_m in row_tiles(rows):
            for block_n, block_k, programs, warps, stages in candidates(block_m):
                split = split_for(rows, n, k, block_m, block_n, block_k, programs)
                config = (block_m, block_n, block_k, split, warps, stages)
                if "x".join(map(str, config)) in timed:
                    continue
                try:
                    timed["x".join(map(str, config))] = skinny(config)
                except Exception as err:  # noqa: BLE001 - a tile too big for shared memory
                    print(f"skip {config}: {type(err).__name__}", flush=True)
        best = min(timed, key=timed.__getitem__)
        result.update({"best_us": timed[best], "best": best, "sweep_us": timed})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="2,4,8,16,32,64,128,256")
    parser.add_argument("--sweep", action="store_true", help="time every skinny tile candidate")
    parser.add_argument("--out", default="bench/results/fp8_gemm.json")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(2 << 30, device)["GB_per_s"]
    layer = [(name, n, k) for name, n, k, act in projections("llama-3-8b") if act is None]
    layer = [p for p in layer if p[0] != "lm_head"]
    paths = ("bf16", "scaled_mm", "skinny", "engine")
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        for name, n, k in layer:
            res = bench_one(n, k, m, args.sweep, device)
            row = {"M": m, "proj": name, "N": n, "K": k}
            row.update({f"{p} us": res[f"{p}_us"] for p in paths})
            row["engine speed-up"] = res["bf16_us"] / res["engine_us"]
            row["bf16 % of copy"] = 100 * n * k * 2 / (res["bf16_us"] * 1e3) / bandwidth
            for p in paths[1:]:
                if res[f"{p}_us"] is not None:
                    row[f"{p} % of copy"] = 100 * n * k / (res[f"{p}_us"] * 1e3) / bandwidth
            for p in ("bf16", "engine"):  # what prefill-sized M is about: arithmetic
                row[f"{p} TFLOP/s"] = 2 * m * n * k / (res[f"{p}_us"] * 1e6)
            row["picked"] = res["picked"]
            if args.sweep:
                row.update({"best us": res["best_us"], "best": res["best"]})
                row["sweep us"] = res["sweep_us"]
            rows.append(row)
            print({c: v for c, v in row.items() if c != "sweep us"}, flush=True)
    layers = SHAPES["llama-3-8b"]["num_hidden_layers"]
    per_step = []
    for m in dict.fromkeys(r["M"] for r in rows):
        mine = [r for r in rows if r["M"] == m]
        step = {"M": m}
        for p in paths:
            if all(r[f"{p} us"] is not None for r in mine):
                step[f"{p} ms/step"] = sum(r[f"{p} us"] for r in mine) * layers / 1e3
        floor = sum(r["N"] * r["K"] for r in mine) * layers / (bandwidth * 1e9) * 1e3
        step["fp8 floor ms"] = floor
        step["engine / floor"] = step["engine ms/step"] / floor
        step["engine speed-up"] = step["bf16 ms/step"] / step["engine ms/step"]
        per_step.append(step)
    write_results(
        args.out,
        {
            "benchmark": "fp8_gemm",
            "device": device_name(),
            "copy_bandwidth_GBps": bandwidth,
            "rows": rows,
            "per_step": per_step,
        },
    )
    print(f"device: {device_name()}  Llama-3-8B projections  copy bandwidth {bandwidth:.0f} GB/s")
    shown = ["M", "proj", *(f"{p} us" for p in paths), "engine speed-up", "skinny % of copy"]
    shown += ["bf16 TFLOP/s", "engine TFLOP/s"]
    shown += ["picked"] + (["best us", "best"] if args.sweep else [])
    print(table(rows, shown))
    print(table(per_step, list(dict.fromkeys(c for step in per_step for c in step))))


if __name__ == "__main__":
    main()
