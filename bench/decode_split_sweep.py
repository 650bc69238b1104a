"""How the split count of paged decode attention moves its bandwidth (tunes choose_num_splits).

python -m bench.decode_split_sweep   (GPU; 32 q / 8 KV heads, head 128, block 16, bf16)
"""

from __future__ import annotations

import torch
import triton

from bench.common import copy_bandwidth, table
from splitserve.kernels.decode_attention import choose_num_splits, decode_attention


def main() -> None:
    bandwidth = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, context in ((1, 2048), (1, 8192), (16, 2048), (16, 8192), (64, 2048)):
        blocks_per_seq = context // 16
        num_blocks = batch * blocks_per_seq
        cache = torch.randn(2, num_blocks, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
        tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, -1)
        lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
        moved = cache.numel() * 2 + 2 * q.numel() * 2
        default = choose_num_splits(batch, 8, context, sms)
        for splits in sorted({1, 2, 4, 8, 12, 16, 24, 32, default}):
            if splits > context // 64:
                continue
            args = (q, cache, tables, lens, 0.088)
            ms = triton.testing.do_bench(
                lambda a=args, c=context, s=splits: decode_attention(
                    *a, max_seq_len=c, num_splits=s
                ),
                return_mode="median",
            )
            rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "splits": splits,
                    "default": "*" if splits == default else "",
                    "us": ms * 1e3,
                    "% copy bw": 100 * moved / (ms / 1e3) / bandwidth,
                }
            )
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, {sms} SMs")
    print(table(rows, ["batch", "context", "splits", "default", "us", "% copy bw"]))
    print(
        table(launch_config_rows(bandwidth, sms), ["config", "batch", "context", "us", "% copy bw"])
    )


def launch_config_rows(bandwidth: float, sms: int) -> list[dict]:
    """The same kernel under other (BLOCK_N, num_warps, num_stages), default splits."""
    import splitserve.kernels.decode_attention as mod

    default = mod._launch_config
    rows = []
    try:
        for config in ((64, 4, 2), (128, 8, 2), (128, 4, 2), (64, 4, 3), (64, 8, 3), (32, 4, 3)):
            mod._launch_config = lambda dtype, cache_dtype=None, c=config: c
            for batch, context in ((16, 2048), (16, 8192), (64, 2048)):
                num_blocks = batch * context // 16
                cache = torch.randn(2, num_blocks, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
                tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
                lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
                q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
                args = (q, cache, tables.view(batch, -1), lens, 0.088)
                ms = triton.testing.do_bench(
                    lambda a=args, c=context: decode_attention(*a, max_seq_len=c),
                    return_mode="median",
                )
                moved = cache.numel() * 2 + 2 * q.numel() * 2
                rows.append(
                    {
                        "config": str(config),
                        "batch": batch,
                        "context": context,
                        "us": ms * 1e3,
                        "% copy bw": 100 * moved / (ms / 1e3) / bandwidth,
                    }
                )
    finally:
        mod._launch_config = default
    return rows


if __name__ == "__main__":
    main()
