"""MLA prefill attention: the engine's path over the latent cache against attention over per-head
keys and values (what a per-head cache of the same model would run).

DeepSeek-V2-Lite's attention (16 heads; keys 128 + 64 RoPE, values 128; latent 512 + 64), bf16,
one fresh prompt per row. Timed per layer:
- latent: `MLAttention._attend` as a prefill step runs it: the prompt's latents gathered from the
  paged cache, decompressed through `kv_b_proj` into per-head keys and values, then attention;
- per-head: the same attention over keys and values already laid out per head (no gather, no
  decompression): the cost of the same prefill with a per-head cache;
- unpadded SDPA: the per-head attention without `mla.attention`'s padding of the values to the
  keys' width (what the flash kernel needs): the padding's worth. (Both pass SDPA 4-D inputs:
  3-D ones run its math path, which is what this bench first measured: about 11 TFLOP/s.)
Attention FLOPs counted causal: 2 x heads x L^2 / 2 x (qk_head_dim + v_head_dim); the latent
row's rate counts the same FLOPs (decompression is its overhead, not work a per-head cache does).

    python -m bench.mla_prefill [--out bench/results/mla_prefill.json]
    python -m bench.mla_prefill --smoke     # tiny shapes; runs on a CPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import SHAPES, device_name, median_time, table, write_results  # noqa: E402
from bench.kernels import shuffled_tables  # noqa: E402
from splitserve.engine.attention import AttentionMetadata  # noqa: E402
from splitserve.engine.mla import MLAttention, attention  # noqa: E402
from splitserve.engine.model_config import ModelConfig  # noqa: E402
from splitserve.engine.ops import TorchOps  # noqa: E402
from splitserve.engine.rotary import RotaryEmbedding  # noqa: E402

BLOCK = 16
SMOKE = {
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "hidden_size": 64,
}


def layer(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> MLAttention:
    rotary = RotaryEmbedding(cfg.rope, cfg.mla.qk_rope_head_dim, 16)  # type: ignore[union-attr]
    attn = MLAttention(cfg, rotary, TorchOps()).to(device, dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.02)
    return attn


def row(attn: MLAttention, length: int, device: torch.device, dtype: torch.dtype) -> dict:
    mla, heads = attn.mla, attn.num_heads
    blocks = -(-length // BLOCK)
    pool = torch.randn(blocks, 2, 1, BLOCK, 1, mla.latent_dim, device=device, dtype=dtype)
    cache = pool[:, 0].transpose(0, 1)  # one layer's view of a block-major pool
    tables = shuffled_tables(1, blocks, device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(length, device=device),
        cu_seqlens_q=torch.tensor([0, length], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([length], dtype=torch.int32, device=device),
        block_tables=tables,
        query_lens_cpu=(length,),
        seq_lens_cpu=(length,),
        block_size=BLOCK,
    )
    q = torch.randn(length, heads, mla.qk_head_dim, device=device, dtype=dtype)
    k = torch.randn(heads, length, mla.qk_head_dim, device=device, dtype=dtype)
    v = torch.randn(heads, length, mla.v_head_dim, device=device, dtype=dtype)
    qt = q.transpose(0, 1)

    def per_head() -> torch.Tensor:
        return attention(qt, k, v, None, True, mla.softmax_scale)

    def per_head_unpadded() -> torch.Tensor:  # 4-D SDPA, values narrower than the keys
        out = F.scaled_dot_product_attention(
            qt[None], k[None], v[None], is_causal=True, scale=mla.softmax_scale
        )
        return out[0]

    with torch.inference_mode():
        latent_s = median_time(lambda: attn._attend(q, cache, meta), reps=10, warmup=2)
        per_head_s = median_time(per_head, reps=10, warmup=2)
        unpadded_s = median_time(per_head_unpadded, reps=10, warmup=2)
    flops = 2 * heads * length * length / 2 * (mla.qk_head_dim + mla.v_head_dim)
    return {
        "tokens": length,
        "latent ms": latent_s * 1e3,
        "per-head ms": per_head_s * 1e3,
        "latent TFLOP/s": flops / latent_s / 1e12,
        "per-head TFLOP/s": flops / per_head_s / 1e12,
        "latent / per-head": latent_s / per_head_s,
        "unpadded SDPA TFLOP/s": flops / unpadded_s / 1e12,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/mla_prefill.json"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and prompts (CPU)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    raw = {**SHAPES["deepseek-v2-lite"], **(SMOKE if args.smoke else {})}
    cfg = ModelConfig.from_hf_dict(raw)
    lengths = [64, 200] if args.smoke else args.lengths
    attn = layer(cfg, device, dtype)
    rows = [row(attn, n, device, dtype) for n in lengths]
    result = {
        "benchmark": "mla_prefill",
        "device": device_name(),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "shape": "smoke" if args.smoke else "deepseek-v2-lite",
        "flops": "causal attention: 2 x heads x L^2 / 2 x (qk_head_dim + v_head_dim)",
        "rows": rows,
    }
    print(f"{result['device']}  {result['dtype']}  one layer, one fresh prompt per row")
    print(table(rows, list(rows[0])))
    write_results(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
