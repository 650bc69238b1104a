"""Benchmark 3 (docs: DESIGN.md): the Triton attention kernels against the device's own limits.

- Copy bandwidth: a large device-to-device copy (bytes read + written), the roofline for decode.
- Paged decode attention, 32 query / 8 KV heads, head_dim 128, block 16: batch x context grid;
  achieved GB/s (K and V bytes read, plus q and out) and its share of the copy bandwidth.
- Paged prefill attention (fresh causal prompts): TFLOP/s, beside torch SDPA (contiguous K/V, no
  paging) on the same shapes in the same run.

Every timing is the median of `triton.testing.do_bench` repetitions, which flushes the L2 cache
before each one. KV caches hold random values and block tables are shuffled pages.

    python bench/kernels.py [--out bench/results/kernels.json]
    TRITON_INTERPRET=1 python bench/kernels.py --smoke      # tiny shapes; checks it runs on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    # NOTE: run as `python bench/kernels.py`, sys.path[0] is bench/, where this very file would
    # shadow the `kernels` package; the repository root goes there instead.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from splitserve.kernels.decode_attention import (  # noqa: E402
    INTERPRETER_NUM_SMS,
    choose_num_splits,
    decode_attention,
    decode_attention_ref,
)
from splitserve.kernels.prefill_attention import prefill_attention, prefill_attention_ref  # noqa: E402


@dataclass(frozen=True)
class Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill: tuple[tuple[int, int], ...]  # (batch, seq_len)
    copy_bytes: int


FULL = Shapes(
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    block_size=16,
    decode_batches=(1, 16, 64, 256),
    decode_contexts=(512, 2048, 8192, 32768),
    prefill=((1, 1024), (1, 4096), (1, 16384), (4, 2048), (16, 512)),
    copy_bytes=2 << 30,
)
SMOKE = Shapes(8, 2, 32, 16, (1, 4), (64, 256), ((1, 64), (2, 48)), copy_bytes=4 << 20)


def copies_beyond_l2(num_bytes: int, device: torch.device) -> int:
    """How many disjoint inputs make the data touched per replay at least twice the L2."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    limit = 0.6 * free_bytes(device)
    return max(1, min(-(-2 * l2 // max(num_bytes, 1)), int(limit // max(num_bytes, 1)), 16))


def time_graph_us(calls: list[Callable[[], object]], device: torch.device) -> float:
    """Median time of one call, from CUDA-graph replays of all `calls` (CPU: wall clock)."""
    if device.type != "cuda":
        return time_us(calls[0], device)

    def run_all() -> None:
        for call in calls:
            call()

    # NOTE: do_bench_cudagraph runs on a stream of its own: the inputs, made on the default
    # stream, must be complete first (random block tables half written are wild pointers).
    torch.cuda.synchronize(device)

    return (
        triton.testing.do_bench_cudagraph(run_all, rep=100, return_mode="median") * 1e3 / len(calls)
    )


def time_us(fn: Callable[[], object], device: torch.device) -> float:
    """Median time of one call in microseconds."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    # The interpreter: wall clock of a few calls, only to show the program runs end to end.
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def copy_bandwidth(num_bytes: int, device: torch.device) -> dict:
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), device)
    return {"bytes_copied": num_bytes, "us": us, "GB_per_s": 2 * num_bytes / us / 1e3}


LAYOUTS = ("block", "layer")
POOL_LAYERS = 2  # layers in the block-major pool the "block" layout views (memory: 2x)


def random_paged_cache(
    num_blocks: int, shapes: Shapes, dtype: torch.dtype, device: torch.device, layout: str
) -> torch.Tensor:
    """One layer's [2, num_blocks, block_size, heads, dim] cache: a view of a block-major pool
    ("block", the engine's layout: pages `POOL_LAYERS` layers apart) or its own contiguous
    tensor ("layer", the layout before the block-major pool)."""
    block = (shapes.block_size, shapes.num_kv_heads, shapes.head_dim)
    if layout == "layer":
        return torch.randn((2, num_blocks, *block), dtype=dtype, device=device)
    pool = torch.randn((num_blocks, POOL_LAYERS, 2, *block), dtype=dtype, device=device)
    return pool[:, 0].transpose(0, 1)


def shuffled_tables(batch: int, blocks_per_seq: int, device: torch.device) -> torch.Tensor:
    pages = torch.randperm(batch * blocks_per_seq, device=device)
    return pages.view(batch, blocks_per_seq).to(torch.int32)


def free_bytes(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 8 << 30


def check_correctness(shapes: Shapes, dtype: torch.dtype, device: torch.device) -> None:
    """Both kernels against their references on one small case, before any number is taken."""
    atol = 1e-4 if dtype == torch.float32 else 3e-2
    bs, h, d = shapes.block_size, shapes.num_heads, shapes.head_dim
    cache = random_paged_cache(8, shapes, dtype, device, "block")
    tables = shuffled_tables(2, 4, device)
    seq_lens = torch.tensor([4 * bs - 3, 2 * bs + 1], dtype=torch.int32, device=device)
    q = torch.randn(2, h, d, dtype=dtype, device=device)
    decode_args = (q, cache, tables, seq_lens, d**-0.5)
    got, want = decode_attention(*decode_args), decode_attention_ref(*decode_args)
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    lens = seq_lens.tolist()
    q = torch.randn(sum(lens), h, d, dtype=dtype, device=device)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=device)
    prefill_args = (q, cache, tables, cu, seq_lens, max(lens), d**-0.5)
    got, want = prefill_attention(*prefill_args), prefill_attention_ref(*prefill_args)
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)


def bench_decode(
    shapes: Shapes, dtype: torch.dtype, device: torch.device, copy_gbps: float, layout: str
) -> list[dict]:
    elem = torch.empty((), dtype=dtype).element_size()
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        num_sms = INTERPRETER_NUM_SMS
    h, hkv, d, bs = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim, shapes.block_size
    rows = []
    for batch in shapes.decode_batches:
        for context in shapes.decode_contexts:
            kv_bytes = 2 * batch * context * hkv * d * elem
            row: dict = {"layout": layout, "batch": batch, "context": context}
            pool_factor = POOL_LAYERS if layout == "block" else 1
            if kv_bytes * pool_factor > 0.8 * free_bytes(device):
                rows.append({**row, "skipped": f"KV needs {kv_bytes / 2**30:.1f} GiB"})
                continue
            blocks_per_seq = context // bs
            # NOTE: timed as the engine runs it, inside a CUDA graph (no host launch overhead),
            # over `copies` disjoint sets of pages so that no call finds its KV in L2.
            copies = copies_beyond_l2(kv_bytes, device)
            num_pages = copies * batch * blocks_per_seq
            cache = random_paged_cache(num_pages, shapes, dtype, device, layout)
            tables = shuffled_tables(copies * batch, blocks_per_seq, device).view(copies, batch, -1)
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            q = torch.randn(batch, h, d, dtype=dtype, device=device)
            out = torch.empty_like(q)
            calls = [
                partial(decode_attention, q, cache, tables[i], seq_lens, d**-0.5, out=out)
                for i in range(copies)
            ]
            us = time_graph_us(calls, device)
            gbps = (kv_bytes + 2 * q.numel() * elem) / us / 1e3
            splits = choose_num_splits(batch, hkv, context, num_sms)
            pct = 100 * gbps / copy_gbps
            rows.append(
                {
                    **row,
                    "num_splits": splits,
                    "page_sets": copies,
                    "us": us,
                    "GB_per_s": gbps,
                    "pct_of_copy": pct,
                }
            )
            del cache, tables, seq_lens, q, out
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def bench_prefill(
    shapes: Shapes, dtype: torch.dtype, device: torch.device, layout: str
) -> list[dict]:
    h, d, bs = shapes.num_heads, shapes.head_dim, shapes.block_size
    rows = []
    for batch, seq_len in shapes.prefill:
        blocks_per_seq = -(-seq_len // bs)
        cache = random_paged_cache(batch * blocks_per_seq, shapes, dtype, device, layout)
        tables = shuffled_tables(batch, blocks_per_seq, device)
        seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
        cu = torch.arange(0, batch * seq_len + 1, seq_len, dtype=torch.int32, device=device)
        q = torch.randn(batch * seq_len, h, d, dtype=dtype, device=device)
        out = torch.empty_like(q)
        args = (q, cache, tables, cu, seq_lens, seq_len, d**-0.5)
        us = time_us(partial(prefill_attention, *args, out=out), device)
        # Baseline: SDPA on the same keys laid out contiguously, heads expanded for GQA.
        q4 = q.view(batch, seq_len, h, d).transpose(1, 2)
        keys = torch.randn(batch, h, seq_len, d, dtype=dtype, device=device)
        values = torch.randn_like(keys)
        sdpa = partial(F.scaled_dot_product_attention, q4, keys, values, is_causal=True)
        sdpa_us = time_us(sdpa, device)
        flops = 2 * 2 * h * d * batch * seq_len * seq_len / 2
        rows.append(
            {
                "layout": layout,
                "batch": batch,
                "seq_len": seq_len,
                "us": us,
                "TFLOP_per_s": flops / us / 1e6,
                "sdpa_us": sdpa_us,
                "sdpa_TFLOP_per_s": flops / sdpa_us / 1e6,
                "vs_sdpa": sdpa_us / us,
            }
        )
    return rows


def print_tables(result: dict) -> None:
    copy = result["copy_bandwidth"]
    print(f"{result['device']}  {result['dtype']}  copy bandwidth {copy['GB_per_s']:.0f} GB/s")
    print("\npaged decode  layout  batch  context  splits        us      GB/s  % of copy")
    for r in result["decode"]["rows"]:
        if "skipped" in r:
            head = f"{'':14}{r['layout']:6}{r['batch']:7d}{r['context']:9d}"
            print(f"{head}  skipped: {r['skipped']}")
            continue
        print(
            f"{'':14}{r['layout']:6}{r['batch']:7d}{r['context']:9d}{r['num_splits']:8d}"
            f"{r['us']:10.1f}{r['GB_per_s']:10.0f}{r['pct_of_copy']:10.1f}"
        )
    print("\npaged prefill layout  batch  seq_len        us  TFLOP/s   SDPA TFLOP/s  vs SDPA")
    for r in result["prefill"]["rows"]:
        print(
            f"{'':14}{r['layout']:6}{r['batch']:7d}{r['seq_len']:9d}{r['us']:10.1f}"
            f"{r['TFLOP_per_s']:9.1f}{r['sdpa_TFLOP_per_s']:15.1f}{r['vs_sdpa']:9.2f}"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/kernels.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--layout",
        choices=(*LAYOUTS, "both"),
        default="both",
        help="block: pages of a block-major pool (the engine's); layer: one tensor per layer",
    )
    args = parser.parse_args(argv)
    layouts = LAYOUTS if args.layout == "both" else (args.layout,)

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # The interpreter mishandles bfloat16 dots, so the CPU smoke run uses float32.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = SMOKE if args.smoke else FULL
    check_correctness(shapes, dtype, device)
    copy = copy_bandwidth(shapes.copy_bytes, device)
    fields = asdict(shapes)
    attention_shape = {k: fields[k] for k in ("num_heads", "num_kv_heads", "head_dim")}
    result = {
        "benchmark": "kernels",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "smoke": args.smoke,
        "timing": (
            "decode: median of CUDA-graph replays (triton do_bench_cudagraph) over "
            "disjoint page sets >= 2x L2; prefill: median of triton do_bench, L2 flushed"
        )
        if device.type == "cuda"
        else "CPU interpreter wall clock: not a performance number",
        "copy_bandwidth": copy,
        "decode": {
            **attention_shape,
            "block_size": shapes.block_size,
            "bytes_counted": "K and V of every context token once per KV head, plus q and out",
            "layouts": list(layouts),
            "rows": [
                row
                for layout in layouts
                for row in bench_decode(shapes, dtype, device, copy["GB_per_s"], layout)
            ],
        },
        "prefill": {
            **attention_shape,
            "block_size": shapes.block_size,
            "flops_counted": "causal: 2 * 2 * heads * head_dim * sum(seq_len^2) / 2",
            "baseline": "torch SDPA, is_causal, contiguous K/V expanded to all heads",
            "rows": [
                row for layout in layouts for row in bench_prefill(shapes, dtype, device, layout)
            ],
        },
    }
    print_tables(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
