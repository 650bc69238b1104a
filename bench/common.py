"""What every benchmark shares: model shapes, a model directory for dummy weights, the device's
measured copy bandwidth, and writing results (a table on stdout, JSON on disk)."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Published shapes (config.json fields), run with random weights.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    # DeepSeek's MLA (latent 512 + rope 64) and MoE (64 routed experts top-6, 2 shared, the
    # first layer dense), as its config.json has them (rope_scaling: YaRN)
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_shared_experts": 2,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "max_position_embeddings": 163840,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
}


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens touch when each picks `top_k` of `num_experts` uniformly:
    E * (1 - (1 - k/E)^T)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def model_dir(shape: str, root: Path) -> Path:
    """A model directory with `shape`'s config.json and a local tokenizer, and no weights (the
    engine runs it with load_format="dummy"; token-id prompts make the tokenizer irrelevant)."""
    from splitserve.testing.tiny_model import make_tiny_model

    path = root / shape
    make_tiny_model(path, "llama")
    for weights in path.glob("*.safetensors*"):
        weights.unlink()
    (path / "config.json").write_text(json.dumps({**SHAPES[shape], "torch_dtype": "bfloat16"}))
    return path


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()})"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_time(fn: Callable[[], Any], reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of `fn` (synchronised around each run)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Measured device copy bandwidth in bytes/s (bytes read + bytes written)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.randn(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), reps=20)
    return 2 * num_bytes / seconds


def decode_room(engine: Any, context: int) -> int:
    """Tokens a sequence of `context` tokens may decode: all the room the engine has. Chunked
    prefill lets the first sequences of a batch decode while the rest prefill (a large batch
    takes batch * context / 2048 steps to fill): a shorter budget ends some of them before the
    batch is timed (`check_whole_batch`)."""
    return int(engine.max_model_len) - context


def check_whole_batch(engine: Any, batch: int) -> None:
    """Stop the benchmark unless all `batch` sequences still run: a step timed after some
    finished (or were preempted) is a smaller batch's."""
    running = len(engine.scheduler.running)
    if running != batch:
        raise SystemExit(
            f"batch {batch}: only {running} sequences ran when timed (their token budget, the "
            "KV pool or the model's length ran out); raise --max-model-len or the pool"
        )


def write_results(path: str | Path, results: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    # NOTE: no rows (a run that failed first) prints the header alone
    widths = {c: max([len(c), *(len(_fmt(r.get(c))) for r in rows)]) for c in columns}
    lines = ["  ".join(c.rjust(widths[c]) for c in columns)]
    lines += ["  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "" if value is None else str(value)
