"""KV bytes a long Gemma 3 sequence holds with sliding layers in a window pool, against keeping
every block for every layer (engine/window_slots.py), and what that does to decode steps.

One sequence of `--context` prompt tokens (default 32,704: with 64 decoded, 32,768, the
model's whole context) runs to the end on Gemma-3-270M's shape (18 layers, every 6th full,
window 512, one KV head of 256; dummy weights, bf16) twice: sliding layers in their window
pool, then with `sliding_window_kv=False`. After every step it records the KV bytes the
sequence holds (full layers' blocks in use, sliding layers' slots in use; each a block of
keys and values per layer) and, for the same memory budget, how many blocks each pool gets.
Both runs' tokens must agree.

    python -m bench.sliding_window_kv                      # GPU, 32,768 tokens
    python -m bench.sliding_window_kv --device cpu --context 1200 --steps 8   # a smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import device_name, sync, table, write_results

GEMMA3_270M = {
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "layer_types": [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)
    ],
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
}


def model_dir(root: Path) -> Path:
    """Gemma-3-270M's config.json as transformers writes it, a local tokenizer, no weights."""
    from transformers import Gemma3TextConfig

    from splitserve.testing.tiny_model import make_tiny_model

    path = root / "gemma-3-270m"
    make_tiny_model(path, "llama")
    for weights in path.glob("*.safetensors*"):
        weights.unlink()
    raw = Gemma3TextConfig(**GEMMA3_270M, bos_token_id=2, eos_token_id=1).to_dict()
    raw |= {"architectures": ["Gemma3ForCausalLM"], "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(raw))
    return path


def held_bytes(engine) -> int:
    """KV bytes the running sequences hold: each block or slot in use is keys and values of
    `block_size` tokens for each layer of its pool."""
    usage = engine.kv_usage()
    cache = engine.kv_cache
    per_block = cache.pool[0].numel() * cache.pool.element_size()
    held = usage.num_used_blocks * per_block
    if cache.window_pool is not None:
        per_slot = cache.window_pool[0].numel() * cache.window_pool.element_size()
        held += usage.num_window_slots_held * per_slot
    return held


def run(path: Path, args: argparse.Namespace, window: bool) -> dict:
    from splitserve.engine import LLMEngine, SamplingParams
    from splitserve.engine.config import EngineConfig

    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    engine = LLMEngine(
        path,
        EngineConfig(
            dtype=torch.bfloat16,
            device=args.device,
            load_format="dummy",
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.context + args.steps,
            kv_cache_memory_bytes=args.kv_cache_gib << 30,
            sliding_window_kv=window,
        ),
    )
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    request = engine.add_request([10 + i % 5000 for i in range(args.context)], params)
    held, step_s, tokens = [], [], []
    while engine.has_unfinished_requests():
        decoding = bool(engine.scheduler.running) and all(
            s.num_computed_tokens >= s.num_tokens - 1 for s in engine.scheduler.running
        )
        sync()
        start = time.perf_counter()
        outputs = engine.step()
        sync()
        if decoding:
            step_s.append(time.perf_counter() - start)
        held.append(held_bytes(engine))
        tokens += [o.outputs[0].token_ids for o in outputs if o.request_id == request]
    cache = engine.kv_cache
    pools = cache.pool.numel() * cache.pool.element_size()
    if cache.window_pool is not None:
        pools += cache.window_pool.numel() * cache.window_pool.element_size()
    engine.check_integrity()
    return {
        "pool": "window" if window else "every block",
        "tokens": args.context + args.steps,
        "held MiB": max(held) / 2**20,
        "held at end MiB": held[-2] / 2**20 if len(held) > 1 else held[-1] / 2**20,
        "blocks": engine.config.num_kv_blocks,
        "window slots": engine.config.num_window_slots or 0,
        "pools MiB": pools / 2**20,
        "decode step ms": statistics.median(step_s) * 1e3 if step_s else 0.0,
        "_token_ids": tokens[-1] if tokens else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--context", type=int, default=32768 - 64)
    parser.add_argument("--steps", type=int, default=64, help="tokens decoded after the prompt")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-gib", type=int, default=8)
    parser.add_argument("--out", default="bench/results/sliding_window_kv.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(Path(tmp))
        rows = [run(path, args, window=True), run(path, args, window=False)]
    same = rows[0].pop("_token_ids") == rows[1].pop("_token_ids")
    ratio = rows[0]["held at end MiB"] / rows[1]["held at end MiB"]
    print(table(rows, list(rows[0])))
    print(f"held by the window pool / every block at {rows[0]['tokens']} tokens: {ratio:.3f}")
    print(f"tokens identical: {same}")
    write_results(
        args.out,
        {
            "device": device_name(),
            "shape": "gemma-3-270m",
            "rows": rows,
            "held_ratio": ratio,
            "tokens_identical": same,
        },
    )
    if not same:
        raise SystemExit("the window pool changed the tokens")


if __name__ == "__main__":
    main()
