"""The absorbed MLA decode attention kernel (kernels/mla_decode.py) against the device's copy
bandwidth.

DeepSeek-V2-Lite's attention: 16 heads, latent 512 + 64, bf16, block 16; a batch x context grid.
Bytes counted: every context token's latent row once (all heads share it), plus q and the latent
output. The floor is a large device-to-device copy measured in the same run (bench/kernels.py).
Target (issue 45): >= 2.5 TB/s at batch 64 with 4k-token contexts.

Timed as the engine runs it, inside a CUDA graph, over disjoint page sets >= 2x L2 (the median of
replays). KV caches hold random values and block tables are shuffled pages.

    python bench/mla_decode.py [--out bench/results/mla_decode.json]
    TRITON_INTERPRET=1 python bench/mla_decode.py --smoke   # tiny shapes; runs on a CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    # NOTE: run as `python bench/mla_decode.py`: the repository root goes first (see kernels.py).
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import triton  # noqa: E402

from bench.kernels import (  # noqa: E402
    copies_beyond_l2,
    copy_bandwidth,
    free_bytes,
    shuffled_tables,
    time_graph_us,
)
from splitserve.kernels.decode_attention import INTERPRETER_NUM_SMS, choose_num_splits  # noqa: E402
from splitserve.kernels.mla_decode import BLOCK_H, mla_decode, mla_decode_ref  # noqa: E402

TARGET_GB_PER_S = 2500.0
TARGET_AT = (64, 4096)  # (batch, context)
POOL_LAYERS = 2  # the engine's block-major pool: pages POOL_LAYERS layers apart


@dataclass(frozen=True)
class Shapes:
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    block_size: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    copy_bytes: int


FULL = Shapes(16, 512, 64, 16, (1, 16, 64, 128, 256), (1024, 4096, 16384), copy_bytes=2 << 30)
SMOKE = Shapes(4, 32, 8, 16, (1, 4), (64, 256), copy_bytes=4 << 20)


def latent_cache(num_blocks: int, shapes: Shapes, dtype: torch.dtype, device: torch.device):
    """One layer's [1, num_blocks, block_size, 1, latent_dim] view of a block-major pool."""
    latent = shapes.kv_lora_rank + shapes.rope_dim
    pool = torch.randn(
        (num_blocks, POOL_LAYERS, 1, shapes.block_size, 1, latent), dtype=dtype, device=device
    )
    return pool[:, 0].transpose(0, 1)


def check_correctness(shapes: Shapes, dtype: torch.dtype, device: torch.device) -> None:
    atol = 1e-4 if dtype == torch.float32 else 3e-2
    bs, rank = shapes.block_size, shapes.kv_lora_rank
    cache = latent_cache(8, shapes, dtype, device)
    tables = shuffled_tables(2, 4, device)
    seq_lens = torch.tensor([4 * bs - 3, 2 * bs + 1], dtype=torch.int32, device=device)
    q = torch.randn(2, shapes.num_heads, rank + shapes.rope_dim, dtype=dtype, device=device)
    for splits in (1, 3):
        args = (q, cache, tables, seq_lens, rank, 0.1)
        got = mla_decode(*args, num_splits=splits)
        torch.testing.assert_close(got, mla_decode_ref(*args), atol=atol, rtol=atol)


def bench(shapes: Shapes, dtype: torch.dtype, device: torch.device, copy_gbps: float) -> list:
    elem = torch.empty((), dtype=dtype).element_size()
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        num_sms = INTERPRETER_NUM_SMS
    h, rank, bs = shapes.num_heads, shapes.kv_lora_rank, shapes.block_size
    latent = rank + shapes.rope_dim
    rows = []
    for batch in shapes.batches:
        for context in shapes.contexts:
            row: dict = {"batch": batch, "context": context}
            kv_bytes = batch * context * latent * elem
            if kv_bytes * POOL_LAYERS > 0.8 * free_bytes(device):
                rows.append({**row, "skipped": f"KV needs {kv_bytes / 2**30:.1f} GiB"})
                continue
            blocks_per_seq = context // bs
            copies = copies_beyond_l2(kv_bytes, device)
            cache = latent_cache(copies * batch * blocks_per_seq, shapes, dtype, device)
            tables = shuffled_tables(copies * batch, blocks_per_seq, device).view(copies, batch, -1)
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            q = torch.randn(batch, h, latent, dtype=dtype, device=device)
            out = q.new_empty(batch, h, rank)
            calls = [
                partial(
                    mla_decode, q, cache, tables[i], seq_lens, rank, 0.1, out=out,
                    max_seq_len=context,
                )
                for i in range(copies)
            ]  # fmt: skip
            us = time_graph_us(calls, device)
            gbps = (kv_bytes + (q.numel() + out.numel()) * elem) / us / 1e3
            head_blocks = triton.cdiv(h, BLOCK_H)
            rows.append(
                {
                    **row,
                    "num_splits": choose_num_splits(batch, head_blocks, context, num_sms),
                    "page_sets": copies,
                    "us": us,
                    "GB_per_s": gbps,
                    "pct_of_copy": 100 * gbps / copy_gbps,
                }
            )
            del cache, tables, seq_lens, q, out
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def print_table(result: dict) -> None:
    copy = result["copy_bandwidth"]
    print(f"{result['device']}  {result['dtype']}  copy bandwidth {copy['GB_per_s']:.0f} GB/s")
    print("\nabsorbed MLA decode  batch  context  splits        us      GB/s  % of copy")
    for r in result["rows"]:
        head = f"{'':20}{r['batch']:6d}{r['context']:9d}"
        if "skipped" in r:
            print(f"{head}  skipped: {r['skipped']}")
            continue
        print(
            f"{head}{r['num_splits']:8d}{r['us']:10.1f}{r['GB_per_s']:10.0f}"
            f"{r['pct_of_copy']:10.1f}"
        )
    target = result["target"]
    if target["GB_per_s"] is not None:
        verdict = "met" if target["met"] else "NOT met"
        print(
            f"\ntarget {target['want_GB_per_s']:.0f} GB/s at batch {target['batch']}, context "
            f"{target['context']}: {target['GB_per_s']:.0f} GB/s, {verdict}"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/mla_decode.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # The interpreter mishandles bfloat16 dots, so the CPU smoke run uses float32.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = SMOKE if args.smoke else FULL
    check_correctness(shapes, dtype, device)
    copy = copy_bandwidth(shapes.copy_bytes, device)
    rows = bench(shapes, dtype, device, copy["GB_per_s"])
    at = [r for r in rows if (r["batch"], r["context"]) == TARGET_AT and "GB_per_s" in r]
    achieved = at[0]["GB_per_s"] if at else None
    result = {
        "benchmark": "mla_decode",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "smoke": args.smoke,
        "timing": "median of CUDA-graph replays over disjoint page sets >= 2x L2"
        if device.type == "cuda"
        else "CPU interpreter wall clock: not a performance number",
        "shapes": asdict(shapes),
        "bytes_counted": "each context token's latent row once, plus q and the latent output",
        "copy_bandwidth": copy,
        "rows": rows,
        "target": {
            "batch": TARGET_AT[0],
            "context": TARGET_AT[1],
            "want_GB_per_s": TARGET_GB_PER_S,
            "GB_per_s": achieved,
            "met": achieved is not None and achieved >= TARGET_GB_PER_S,
        },
    }
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
