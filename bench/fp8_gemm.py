"""FP8 projections at small batches: what the engine runs for 2-256 rows against bf16 cuBLAS.

    python -m bench.fp8_gemm [--rows 2,8,...] [--out F]

For each Llama-3-8B projection and row count M, the engine's FP8 path for M > 1 (`TritonOps.
linear`: per-token activation quantization, kernels/fp8_quant.py, then rowwise-scaled
`torch._scaled_mm`) against `F.linear` on the bf16 weight. Timed from CUDA-graph replays over
disjoint weight copies totalling >= 2x L2, as in bench/gemv.py. "% of copy" is the weight bytes
(one per FP8 weight, two per bf16 one) over the time, against the device copy bandwidth of the
same run: a memory-bound matmul at these sizes should sit near it. Summed over a layer's four
projections x 32 layers, the last table is what the FP8 matmuls cost per decode step.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import SHAPES, device_name, table, write_results
from bench.gemv import projections
from bench.kernels import copies_beyond_l2, copy_bandwidth, time_graph_us


def bench_one(n: int, k: int, rows: int, device: torch.device) -> dict:
    from splitserve.engine.ops import TritonOps
    from splitserve.engine.quantization import quantize_weight

    ops = TritonOps(pdl=True)
    copies = copies_beyond_l2(n * k * 2, device)
    weights = [
        torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)
    ]
    quantized = [quantize_weight(w) for w in weights]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    bf16_us = time_graph_us([lambda w=w: F.linear(x, w) for w in weights], device)
    fp8_us = time_graph_us(
        [lambda q=q, s=s: ops.linear(x, q, weight_scale=s) for q, s in quantized], device
    )
    return {"bf16_us": bf16_us, "fp8_us": fp8_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="2,4,8,16,32,64,128,256")
    parser.add_argument("--out", default="bench/results/fp8_gemm.json")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a GPU"
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(2 << 30, device)["GB_per_s"]
    layer = [(name, n, k) for name, n, k, act in projections("llama-3-8b") if act is None]
    layer = [p for p in layer if p[0] != "lm_head"]
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        for name, n, k in layer:
            res = bench_one(n, k, m, device)
            rows.append(
                {
                    "M": m,
                    "proj": name,
                    "N": n,
                    "K": k,
                    "bf16 us": res["bf16_us"],
                    "fp8 us": res["fp8_us"],
                    "fp8 speed-up": res["bf16_us"] / res["fp8_us"],
                    "bf16 % of copy": 100 * n * k * 2 / (res["bf16_us"] * 1e3) / bandwidth,
                    "fp8 % of copy": 100 * n * k / (res["fp8_us"] * 1e3) / bandwidth,
                }
            )
    layers = SHAPES["llama-3-8b"]["num_hidden_layers"]
    per_step = []
    for m in dict.fromkeys(r["M"] for r in rows):
        mine = [r for r in rows if r["M"] == m]
        bf16 = sum(r["bf16 us"] for r in mine) * layers / 1e3
        fp8 = sum(r["fp8 us"] for r in mine) * layers / 1e3
        floor = sum(r["N"] * r["K"] for r in mine) * layers / (bandwidth * 1e9) * 1e3
        per_step.append(
            {
                "M": m,
                "bf16 ms/step": bf16,
                "fp8 ms/step": fp8,
                "fp8 floor ms": floor,
                "fp8 / floor": fp8 / floor,
                "fp8 speed-up": bf16 / fp8,
            }
        )
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
    print(table(rows, list(rows[0])))
    print(table(per_step, list(per_step[0])))


if __name__ == "__main__":
    main()
